"""SamplingParams validation and the Sampler: greedy, top-k / top-p / min-p filtering,
temperature, and seeded generators that ignore batch neighbours."""

import pytest
import torch

from sglang.srt.layers.sampler import Sampler, make_generator
from sglang.srt.sampling.sampling_params import SamplingParams

# ---- SamplingParams -------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"max_new_tokens": -1}, "max_new_tokens must be >= 0, got -1"),
        ({"max_new_tokens": "5"}, "max_new_tokens must be an integer"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
        ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": "hot"}, "temperature must be a finite number"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, "top_k must be -1 or >= 1"),
        ({"top_k": -2}, "top_k must be -1 or >= 1"),
        ({"top_k": 2.0}, "top_k must be an integer"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.1}, r"min_p must be in \[0, 1\]"),
        ({"seed": -1}, "seed must be null or an integer"),
        ({"seed": "42"}, "seed must be null or an integer"),
        ({"stop": [1]}, "stop must be a string or a list of strings"),
        ({"stop": 7}, "stop must be a string or a list of strings"),
        ({"stop": [""]}, "stop must not contain an empty string"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids must be a list of integers"),
        ({"stop_token_ids": 3}, "stop_token_ids must be a list of integers"),
        ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
        ({"n": 2}, "n must be 1"),
        ({"temprature": 0.5}, "unknown sampling parameter.*'temprature'"),
    ],
)
def test_bad_sampling_params_raise_value_error_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(bad)


def test_stop_token_ids_are_checked_against_the_vocab():
    SamplingParams(stop_token_ids=[511]).verify(vocab_size=512)
    with pytest.raises(ValueError, match="stop_token_ids entry 512 is outside the vocabulary"):
        SamplingParams(stop_token_ids=[512]).verify(vocab_size=512)


def test_from_dict_defaults_nulls_and_single_stop_string():
    p = SamplingParams.from_dict({"stop": "END", "temperature": None, "top_k": 5, "seed": 3})
    assert p.stop == ["END"] and p.temperature == 1.0 and p.top_k == 5 and p.seed == 3
    assert SamplingParams.from_dict(None) == SamplingParams()
    d = SamplingParams().to_dict()
    assert d["max_new_tokens"] == 128 and d["top_p"] == 1.0 and d["min_p"] == 0.0 and d["n"] == 1
    with pytest.raises(ValueError, match="must be an object"):
        SamplingParams.from_dict([1, 2])


def test_greedy_means_temperature_zero_or_top_k_one():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy


# ---- Sampler --------------------------------------------------------------------------


def _frequencies(logits_row, n, **params):
    """Sample n times from one distribution (n identical rows, the sampler's own generator)."""
    logits = torch.tensor(logits_row, dtype=torch.float32).repeat(n, 1)
    ids = Sampler(seed=0)(logits, [SamplingParams(**params)] * n)
    return torch.bincount(ids, minlength=len(logits_row)).float() / n


def test_greedy_is_argmax_and_top_k_one_or_tiny_top_p_equal_greedy():
    logits = torch.randn(8, 100, generator=make_generator(0))
    argmax = logits.argmax(-1)
    sampler = Sampler(seed=0)
    assert torch.equal(sampler(logits, [SamplingParams(temperature=0.0)] * 8), argmax)
    assert torch.equal(sampler(logits, [SamplingParams(temperature=1.5, top_k=1)] * 8), argmax)
    assert torch.equal(sampler(logits, [SamplingParams(temperature=1.5, top_p=1e-6)] * 8), argmax)


def test_greedy_rows_stay_argmax_next_to_sampled_rows():
    logits = torch.randn(6, 50, generator=make_generator(1))
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    out = Sampler(seed=0)(logits, params)
    assert out[0::2].tolist() == logits.argmax(-1)[0::2].tolist()
    assert out.dtype == torch.int64 and out.shape == (6,)


def test_top_k_top_p_and_min_p_filter_the_tail():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    row = probs.log().tolist()
    # top_k=2 keeps {0, 1}
    f = _frequencies(row, 3000, top_k=2)
    assert f[2] == 0 and f[3] == 0 and abs(f[0] - 0.5 / 0.8) < 0.04
    # top_p=0.7: token 1 starts at mass 0.5 < 0.7 and stays; token 2 starts at 0.8 and goes
    f = _frequencies(row, 3000, top_p=0.7)
    assert f[2] == 0 and f[3] == 0 and f[1] > 0.3
    # min_p=0.2 drops tokens under 0.2 * 0.5 = 0.1: only token 3
    f = _frequencies(row, 3000, min_p=0.2)
    assert f[3] == 0 and f[2] > 0.1 and abs(f[0] - 0.5 / 0.95) < 0.04
    # top-p applies to what top-k left: top_k=3 then top_p=0.6 of 0.95 -> {0, 1}
    f = _frequencies(row, 3000, top_k=3, top_p=0.6)
    assert f[2] == 0 and f[3] == 0
    # unfiltered sampling follows the distribution
    f = _frequencies(row, 8000)
    assert torch.allclose(f, probs, atol=0.03)


def test_a_top_k_past_the_vocabulary_keeps_the_whole_vocabulary():
    # Any JSON integer can arrive; 2**63 once overflowed the int64 tensor and killed the scheduler.
    row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    for top_k in (4, 1000, 2**63, 10**30):
        f = _frequencies(row, 2000, top_k=top_k)
        assert (f > 0).all(), top_k


def test_temperature_sharpens_below_one_and_flattens_above():
    row = [2.0, 1.0, 0.0]
    expected = {t: torch.softmax(torch.tensor(row) / t, 0)[0].item() for t in (0.5, 1.0, 2.0)}
    assert expected[0.5] > 0.85 and expected[2.0] < 0.55  # 0.867, 0.665, 0.506
    freq = {t: _frequencies(row, 4000, temperature=t)[0].item() for t in (0.5, 1.0, 2.0)}
    assert freq[0.5] > freq[1.0] + 0.1 > freq[2.0] + 0.2
    for t in freq:
        assert abs(freq[t] - expected[t]) < 0.05


def test_same_seed_gives_same_tokens():
    logits = torch.zeros(1, 1000)
    p = [SamplingParams(temperature=1.0)]

    def draw(seed):
        g = make_generator(seed)
        sampler = Sampler(seed=99)
        return [sampler(logits, p, [g]).item() for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_seeded_row_ignores_batch_neighbours():
    torch.manual_seed(0)
    row = torch.randn(1, 300)
    neighbours = torch.randn(3, 300)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=5)

    def draw(with_neighbours):
        g = make_generator(5)
        sampler = Sampler(seed=123)
        out = []
        for _ in range(25):
            if with_neighbours:
                batch = torch.cat([neighbours[:1], row, neighbours[1:]])
                params = [SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.0),
                          SamplingParams(temperature=1.3, top_k=7)]
                out.append(sampler(batch, params, [None, g, None, None])[1].item())
            else:
                out.append(sampler(row, [seeded], [g]).item())
        return out

    alone = draw(False)
    assert alone == draw(True)
    assert len(set(alone)) > 5  # it really samples


def test_sampler_rejects_mismatched_params():
    with pytest.raises(ValueError, match="2 logits rows but 1 sampling params"):
        Sampler()(torch.zeros(2, 4), [SamplingParams()])
