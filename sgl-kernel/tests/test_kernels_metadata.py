"""Step-metadata builders (torch reference and Triton): window slot lists, the compressed
entries' lengths and page-table rows (their slots are read through the page table), cache
write locations, compressor emissions; hand-computed cases, then random batches."""

import pytest
import torch

from dsv4_kernels import PageTableList
from kernel_test_utils import require_triton


@pytest.fixture
def page_table(device):
    # Two request slots of 300 positions; request 1 owns raw slots 1000.. in reverse pages.
    req_to_token = torch.full((3, 300), -7, dtype=torch.int32)
    req_to_token[0] = torch.arange(300, dtype=torch.int32) + 512
    req_to_token[2] = (torch.arange(300, dtype=torch.int32) % 128) + 128 * (9 - torch.arange(300) // 128) + 1000
    return req_to_token.to(device)


IMPLS = ["reference", "triton"]


def _impl(name):
    if name == "triton":
        require_triton()
        from dsv4_kernels import metadata

        return metadata
    from dsv4_kernels import reference

    return reference


STAGING = 100  # raw rows: W ring rows per request slot, then one staging row per batch row


def _token_meta(impl, page_table, req, pos, window=4, topk=16):
    """token_metadata for real (valid) tokens, each its request's only new token at `pos`."""
    device = page_table.device
    req = torch.tensor(req, device=device)
    pos = torch.tensor(pos, device=device)
    out = _token_outputs(len(req), window, device)
    rows = torch.arange(len(req), device=device)
    return _impl(impl).token_metadata(req, pos, pos + 1, torch.ones_like(pos), pos, rows, 1, STAGING, topk, out)


@pytest.mark.parametrize("impl", IMPLS)
def test_window_slots_read_this_step_from_staging_and_older_positions_from_the_ring(device, impl):
    """Request 0 extends positions 3..7 (batch rows 0-4), request 2 decodes position 9 (row 5),
    window 4: a window position new in the step is read from its staging row, an older one from
    ring row req * 4 + p % 4; the last 4 positions of each request move to the ring after."""
    t = lambda v: torch.tensor(v, device=device)  # noqa: E731
    req, pos = t([0] * 5 + [2]), t([3, 4, 5, 6, 7, 9])
    prefix, start, seq_len = t([3] * 5 + [9]), t([0] * 5 + [5]), t([8] * 5 + [10])
    out = _token_outputs(6, 4, device)
    _impl(impl).token_metadata(req, pos, seq_len, torch.ones_like(pos), prefix, start, 1, STAGING, 16, out)
    slots, lens = out["window_slots"], out["window_len"]
    assert slots.dtype == torch.int32 and lens.tolist() == [4] * 6
    assert slots.tolist() == [[0, 1, 2, 100], [1, 2, 100, 101], [2, 100, 101, 102], [100, 101, 102, 103],
                              [101, 102, 103, 104], [10, 11, 8, 105]]
    assert out["raw_out_loc"].tolist() == list(range(100, 106))
    # position 3 is not among request 0's last 4 (4..7): its staging row copies onto itself
    assert out["raw_keep_loc"].tolist() == [100, 0, 1, 2, 3, 2 * 4 + 9 % 4]


@pytest.mark.parametrize("impl", IMPLS)
def test_short_windows_are_left_aligned(device, page_table, impl):
    out = _token_meta(impl, page_table, [0, 2], [0, 2])
    assert out["window_len"].tolist() == [1, 3]
    assert out["window_slots"].tolist() == [[100, -1, -1, -1], [8, 9, 101, -1]]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ratio", [4, 128])
def test_compressed_slots_follow_the_last_token_of_each_entry(device, page_table, ratio, impl):
    req, pos = [0, 2, 2, 2, 0], [2, 3, 127, 299, 254]
    out = _token_meta(impl, page_table, req, pos)
    assert out["token_rows"].tolist() == req
    lens = out["cand_len"] if ratio == 4 else out["c128_len"]
    # the entries are read through the page table at each token's row, up to its length
    max_entries = 300 // ratio
    slots = PageTableList(page_table, out["token_rows"], ratio, max_entries).gather(lens)
    assert slots.shape == (5, max_entries)
    for t in range(5):
        n = (pos[t] + 1) // ratio
        assert lens[t] == n
        expected = [int(page_table[req[t], ratio * i + ratio - 1]) // ratio for i in range(n)]
        assert slots[t].tolist() == expected + [-1] * (max_entries - n)
    if ratio == 4:  # the c4 top-k can keep at most topk=16 of them
        assert out["topk_len"].tolist() == [min(16, (p + 1) // 4) for p in pos]


@pytest.mark.parametrize("impl", IMPLS)
def test_write_slots_and_emitting_tokens(device, page_table, impl):
    req, pos = [0, 0, 2, 2], [3, 4, 127, 255]
    out = _token_meta(impl, page_table, req, pos)
    raw = [515, 516, int(page_table[2, 127]), int(page_table[2, 255])]  # compressed entries follow these
    assert out["raw_out_loc"].tolist() == [STAGING + r for r in range(4)]  # raw rows: staging
    t = torch.tensor
    for ratio, rows in ((4, [0, 2, 3]), (128, [2, 3])):  # tokens with (pos + 1) % ratio == 0
        E, R = len(rows), 8 if ratio == 4 else 128
        gather = torch.empty(E, R, dtype=torch.int32, device=device)
        out_loc = torch.empty(E, dtype=torch.int32, device=device)
        emit_pos = torch.empty(E, dtype=torch.int32, device=device)
        # every token is its request's only new token, with pos cached positions before it
        _impl(impl).emission_metadata(
            page_table, t(req, device=device), t(pos, device=device), t([1] * 4, device=device),
            t(pos, device=device), t([0, 1, 2, 3], device=device), t(rows, device=device), E, 1, ratio,
            gather, out_loc, emit_pos)
        assert out_loc.tolist() == [raw[r] // ratio for r in rows]
        assert emit_pos.tolist() == [pos[r] + 1 - ratio for r in rows]
        # the newest source row is the emitting token itself (fresh: -(batch row) - 2)
        assert gather[:, -1].tolist() == [-r - 2 for r in rows]


@pytest.mark.parametrize("impl", IMPLS)
def test_no_tokens_give_empty_metadata(device, page_table, impl):
    out = _token_meta(impl, page_table, [], [], window=128)
    assert out["window_slots"].shape == (0, 128) and out["window_len"].shape == (0,)
    assert out["raw_out_loc"].shape == (0,) and out["cand_len"].shape == (0,) and out["token_rows"].shape == (0,)


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_rows_read_the_padding_request(device, page_table, impl):
    out = _token_outputs(3, 4, device)
    t = lambda v: torch.tensor(v, device=device)  # noqa: E731
    _impl(impl).token_metadata(t([2, 0, 0]), t([9, 5, 7]), t([10, 8, 8]), t([1, 0, 1]), t([9, 0, 7]), t([0, 0, 2]),
                               1, STAGING, 16, out)
    assert out["token_rows"].tolist() == [2, 1, 0]  # padding_slot 1 for the invalid row
    assert out["raw_out_loc"].tolist() == [100, -1, 102] and out["window_len"].tolist() == [4, 0, 4]
    assert out["window_slots"][1].tolist() == [-1] * 4 and out["raw_keep_loc"][1] == 101  # reads, moves nothing
    assert out["cand_len"].tolist() == [2, 0, 2] and out["c128_len"].tolist() == [0, 0, 0]


# ---- one-launch step builders (token_metadata / emission_metadata) -----------------------


def _random_step(T, n_reqs, max_ctx, padding_slot, device, seed):
    """A page table of shuffled raw slots and a batch of n_reqs requests (random prefixes and
    new-token counts, laid out request by request) padded with invalid rows up to T."""
    g = torch.Generator().manual_seed(seed)
    rtt = torch.randperm((n_reqs + 1) * max_ctx + 300, generator=g)[: (n_reqs + 1) * max_ctx].view(n_reqs + 1, max_ctx)
    rtt = rtt.to(torch.int32)
    ext = torch.randint(1, max(2, T // n_reqs), (n_reqs,), generator=g)
    prefix = torch.randint(0, max_ctx - int(ext.max()), (n_reqs,), generator=g)
    prefix[0] = 0  # a request starting from scratch
    n = int(ext.sum())
    assert n <= T
    start = torch.cumsum(ext, 0) - ext
    rows = torch.arange(n)
    req_of_row = torch.repeat_interleave(torch.arange(n_reqs), ext)
    pos = prefix[req_of_row] + rows - start[req_of_row]
    slots = torch.randperm(n_reqs, generator=g)[req_of_row]  # request slots are not in batch order
    pad = T - n
    cat = lambda a, v: torch.cat([a, torch.full((pad,), v, dtype=torch.int64)])  # noqa: E731
    layout = dict(
        req_slot=cat(slots, padding_slot), positions=cat(pos, 0),
        prefix=cat(prefix[req_of_row], 0), chunk_start=cat(start[req_of_row], 0),
        seq_len=cat((prefix + ext)[req_of_row], 0), valid=cat(torch.ones(n, dtype=torch.int64), 0),
    )
    return rtt.to(device), {k: v.to(device) for k, v in layout.items()}, n


def _token_outputs(T, W, device, with_c4=True):
    e = lambda *s, dt=torch.int32: torch.full(s, -77, dtype=dt, device=device)  # noqa: E731
    out = dict(positions=e(T, dt=torch.int64), token_rows=e(T), raw_out_loc=e(T), window_slots=e(T, W),
               window_len=e(T), raw_keep_loc=e(T), c128_len=e(T), ring128=e(T))
    if with_c4:
        out.update(cand_len=e(T), topk_len=e(T), ring4=e(T))
    return out


@pytest.mark.parametrize("T,n_reqs,max_ctx,W,with_c4", [(37, 5, 300, 8, True), (64, 3, 700, 128, True),
                                                       (9, 2, 260, 8, False)])
def test_triton_token_metadata_equals_reference(device, T, n_reqs, max_ctx, W, with_c4):
    require_triton()
    from dsv4_kernels import metadata, reference

    pad_slot = n_reqs
    _, L, _ = _random_step(T, n_reqs, max_ctx, pad_slot, device, seed=T)
    args = (L["req_slot"], L["positions"], L["seq_len"], L["valid"], L["prefix"], L["chunk_start"], pad_slot,
            pad_slot * W, 16)
    expected = reference.token_metadata(*args, _token_outputs(T, W, device, with_c4))
    got = metadata.token_metadata(*args, _token_outputs(T, W, device, with_c4))
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
    # real rows see their request's slots; padding rows nothing
    n_valid = int(L["valid"].sum())
    assert (got["raw_out_loc"][n_valid:] == -1).all() and (got["window_len"][n_valid:] == 0).all()
    assert (got["window_len"][:n_valid] > 0).all()


def test_compressor_ring_rows_are_written_by_one_token_at_most(device):
    """The compressors' ring update skips its winner search on this (rows_unique=True): a
    chunk longer than both rings (128 and 8 rows) still writes each ring row once."""
    from dsv4_kernels import reference

    W, pad_slot = 8, 2
    # slot 0: a 300-token chunk from scratch; slot 1: one decode token at position 50; 3 padding rows
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    n0, pad = 300, 3
    req_slot = i64([0] * n0 + [1] + [pad_slot] * pad)
    positions = i64(list(range(n0)) + [50] + [0] * pad)
    seq_len = i64([n0] * n0 + [51] + [0] * pad)
    valid = i64([1] * (n0 + 1) + [0] * pad)
    prefix = i64([0] * n0 + [50] + [0] * pad)
    chunk_start = i64([0] * n0 + [n0] + [0] * pad)
    T = n0 + 1 + pad
    args = (req_slot, positions, seq_len, valid, prefix, chunk_start, pad_slot, pad_slot * W, 16)
    out = reference.token_metadata(*args, _token_outputs(T, W, device))
    for ring, rows in (("ring128", 128), ("ring4", 8)):
        loc = out[ring][out[ring] >= 0]
        assert loc.numel() == torch.unique(loc).numel(), ring
        assert loc.numel() >= rows  # the long chunk filled its whole ring


@pytest.mark.parametrize("ratio", [4, 128])
def test_triton_emission_metadata_equals_reference(device, ratio):
    require_triton()
    from dsv4_kernels import metadata, reference

    T, n_reqs, max_ctx = 300, 4, 900
    rtt, L, n = _random_step(T, n_reqs, max_ctx, n_reqs, device, seed=ratio)
    emit = torch.nonzero((L["positions"][:n] + 1) % ratio == 0).squeeze(1)
    E, R = emit.numel() + 3, 2 * ratio if ratio == 4 else ratio
    rows = torch.cat([emit, emit.new_zeros(3)])  # three padding emissions
    results = []
    for impl in (reference, metadata):
        outs = (torch.full((E, R), -77, dtype=torch.int32, device=device),
                torch.full((E,), -77, dtype=torch.int32, device=device),
                torch.full((E,), -77, dtype=torch.int32, device=device))
        impl.emission_metadata(rtt, L["req_slot"], L["positions"], L["valid"], L["prefix"], L["chunk_start"],
                               rows, emit.numel(), n_reqs, ratio, *outs)
        results.append(outs)
    for a, b in zip(*results):
        assert torch.equal(a, b)
    gather, out_loc, pos = results[1]
    assert emit.numel() > 0
    assert (gather[-3:] == -1).all() and (out_loc[-3:] == -1).all() and (pos[-3:] == 0).all()
    assert (out_loc[:-3] >= 0).all() and (pos[:-3] % ratio == 0).all()
    assert ((gather[:-3] >= 0) | (gather[:-3] <= -2)).any(dim=1).all()  # every entry has sources


@pytest.mark.parametrize("with_c4", [True, False])
def test_triton_whole_step_in_one_launch_equals_the_reference(device, with_c4):
    """step_metadata: token fields and both ratios' emissions (with padding emissions) from one
    launch, equal to the reference's token_metadata + emission_metadata."""
    require_triton()
    from dsv4_kernels import metadata, reference

    T, n_reqs, max_ctx, W = 300, 4, 900, 8
    rtt, L, n = _random_step(T, n_reqs, max_ctx, n_reqs, device, seed=11)
    ratios = (4, 128) if with_c4 else (128,)
    results = []
    for impl in (reference, metadata):
        out = _token_outputs(T, W, device, with_c4)
        emissions = {}
        for ratio in ratios:
            emit = torch.nonzero((L["positions"][:n] + 1) % ratio == 0).squeeze(1)
            E, R = emit.numel() + 2, 2 * ratio if ratio == 4 else ratio
            emissions[ratio] = (torch.cat([emit, emit.new_zeros(2)]), emit.numel(),
                                torch.full((E, R), -77, dtype=torch.int32, device=device),
                                torch.full((E,), -77, dtype=torch.int32, device=device),
                                torch.full((E,), -77, dtype=torch.int32, device=device))
        impl.step_metadata(rtt, L["req_slot"], L["positions"], L["seq_len"], L["valid"], L["prefix"],
                           L["chunk_start"], n_reqs, n_reqs * W, 16, out, emissions)
        results.append((out, emissions))
    (want, want_em), (got, got_em) = results
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for ratio in ratios:
        assert want_em[ratio][1] > 0
        for a, b in zip(want_em[ratio][2:], got_em[ratio][2:]):
            assert torch.equal(a, b), ratio
    assert (got["window_len"][:n] > 0).all() and (got_em[ratios[-1]][3][-2:] == -1).all()


def test_step_metadata_refuses_a_ratio_the_kernel_does_not_know():
    require_triton()
    from dsv4_kernels import metadata

    idx = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="ratios 4 and 128"):
        metadata.step_metadata(None, idx, idx, idx, idx, idx, idx, 0, 0, 1, {"positions": idx},
                               {16: (idx, 1, torch.zeros(2, 16, dtype=torch.int32), idx, idx)})


@pytest.mark.gpu
def test_gpu_step_builders_at_real_widths():
    from dsv4_kernels import metadata, reference

    T, n_reqs, max_ctx = 2048, 40, 8192
    _, L, _ = _random_step(T, n_reqs, max_ctx, n_reqs, "cuda", seed=1)
    args = (L["req_slot"], L["positions"], L["seq_len"], L["valid"], L["prefix"], L["chunk_start"], n_reqs,
            n_reqs * 128, 512)
    expected = reference.token_metadata(*args, _token_outputs(T, 128, "cuda"))
    got = metadata.token_metadata(*args, _token_outputs(T, 128, "cuda"))
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_keep_window_rows_moves_staging_rows_into_their_ring_rows(device, dtype, impl):
    """Rows of any KV format (float or FP8 bytes): each staging row lands on its keep row; a
    row kept nowhere (its own staging row as target) and every other row stay as they were."""
    if impl == "triton":
        require_triton()
        from dsv4_kernels import window_ring as kernels
    else:
        from dsv4_kernels import reference as kernels

    raw = (torch.arange(14 * 3) % 251).to(dtype).view(14, 3).to(device)
    before = raw.clone()
    keep = torch.tensor([10, 5, 0, 7], dtype=torch.int32, device=device)  # staging rows 10..13
    kernels.keep_window_rows_(raw, 10, keep)
    expected = before.clone()
    expected[5], expected[0], expected[7] = before[11], before[12], before[13]
    assert torch.equal(raw, expected)
    kernels.keep_window_rows_(raw, 10, keep[:0])  # an empty step moves nothing
    assert torch.equal(raw, expected)
