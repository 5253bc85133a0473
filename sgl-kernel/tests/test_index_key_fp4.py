"""Packed FP4 indexer keys (index_key_fp4.py): the layout's round trip, the Triton key write
(rotation + FP4 rounding + pack in one launch) against the in-place rounding it packs, and the
indexer scoring packed keys exactly as float keys holding the same values. Under the
interpreter on CPU, compiled on a GPU."""

import pytest
import torch

from dsv4_kernels import PageTableList, ops, reference
from dsv4_kernels import quant_reference as Q
from dsv4_kernels.index_key_fp4 import IndexKeyFP4Layout, index_key_row_bytes
from kernel_test_utils import paged_page_table, require_triton

D = 128


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().view(torch.int32)


def _spread_rows(n, dim=D, seed=0):
    """Rows over 2^-30 .. 2^12 magnitudes, with an all-zero row, a row under the amax floor,
    -0.0 entries and an outlier per row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g) * torch.exp2(torch.randint(-30, 12, (n, 1), generator=g).float())
    x[:, 3] *= 40
    x[0] = 0.0
    x[1] = torch.randn(dim, generator=g) * 1e-6
    x[2, ::3] = -0.0
    return x


def test_layout_is_68_bytes_at_dim_128():
    layout = IndexKeyFP4Layout(128)
    assert (layout.scale_offset, layout.num_scales, layout.row_bytes) == (64, 4, 68)
    assert index_key_row_bytes(128, True, torch.bfloat16) == 68
    assert (index_key_row_bytes(128, False, torch.bfloat16), index_key_row_bytes(128, False, torch.float32)) == (256, 512)
    assert IndexKeyFP4Layout(32).row_bytes == 17
    with pytest.raises(ValueError, match="multiple of 32"):
        IndexKeyFP4Layout(48)
    with pytest.raises(ValueError, match=r"expected uint8 \[N, 68\]"):
        IndexKeyFP4Layout.of_rows(torch.zeros(4, 128, dtype=torch.uint8), 128)
    with pytest.raises(ValueError, match=r"expected uint8 \[N, 68\]"):
        IndexKeyFP4Layout.of_rows(torch.zeros(4, 68, dtype=torch.bfloat16), 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_rounded_keys_round_trip_bit_for_bit(dtype):
    """What the indexer caches (values FP4-rounded per 32 in the model dtype) comes back with
    every bit, -0.0 included."""
    layout = IndexKeyFP4Layout(D)
    rounded = Q.fp4_round_blocks(_spread_rows(3000).to(dtype))
    assert (_bits(rounded) == _bits(torch.tensor(-0.0))).any()  # negative values rounded to zero
    back = layout.unpack(layout.pack(rounded))
    assert torch.equal(_bits(back), _bits(rounded))
    assert torch.equal(_bits(back.to(dtype)), _bits(rounded))


def test_every_code_at_every_scale_round_trips():
    """Blocks built from e2m1 codes directly: each of the 16 codes at scales 2^-12 .. 2^20 (above
    the amax floor's), in blocks whose largest magnitude is 6, 4, 3 (the rounding's scale, or
    half of it, decodes them) or smaller."""
    layout = IndexKeyFP4Layout(D)
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (4096, D), generator=g)
    codes[:16, :16] = torch.arange(16)
    mag = torch.tensor(Q.E2M1_VALUES)[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    blocks = vals.view(-1, D // 32, 32)
    top = torch.tensor([6.0, 4.0, 3.0, 2.0, 0.5])[torch.randint(0, 5, blocks.shape[:2], generator=g)]
    blocks = torch.maximum(torch.minimum(blocks, top[..., None]), -top[..., None])  # on the grid, -0.0 kept
    blocks[..., 0] = top
    scale = torch.exp2(torch.randint(-12, 21, blocks.shape[:2], generator=g).float())[..., None]
    x = (blocks * scale).flatten(-2)
    assert torch.equal(Q.fp4_round_blocks(x), x)  # really FP4-rounded values
    assert torch.equal(_bits(layout.unpack(layout.pack(x))), _bits(x))


def test_unrounded_keys_are_stored_rounded():
    """pack is the rounding: an unrounded row comes back as fp4_round_blocks gives it (a -0.0
    input stays -0.0 where fp4_round_blocks writes +0.0, the same value)."""
    layout = IndexKeyFP4Layout(D)
    x = _spread_rows(500, seed=2)
    back = layout.unpack(layout.pack(x))
    want = Q.fp4_round_blocks(x)
    assert not torch.equal(want, x)
    assert torch.equal(back, want)
    differ = _bits(back) != _bits(want)
    assert (x[differ] == 0).all() and torch.signbit(x[differ]).all()


def test_pack_matches_quantize_fp4_bytes():
    """The codes and scales are the release's FP4 weight format (quantize_fp4) wherever no value
    rounds to a signed zero (quantize_fp4 stores -0 as +0)."""
    layout = IndexKeyFP4Layout(D)
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(3)) * 5
    x = torch.where(Q.fp4_round_blocks(x) == 0, 1.0, x)
    packed = layout.pack(x)
    codes, scales = Q.quantize_fp4(x)
    assert torch.equal(layout.codes(packed), codes.view(torch.uint8))
    assert torch.equal(layout.scales(packed), scales)


def test_reference_store_skips_minus_one_and_writes_rotated_rounded_rows():
    g = torch.Generator().manual_seed(4)
    layout = IndexKeyFP4Layout(D)
    keys = torch.randn(9, D, generator=g)
    pool = torch.full((20, layout.row_bytes), 7, dtype=torch.uint8)
    loc = torch.tensor([3, -1, 0, 19, 5, -1, 11, 12, 2], dtype=torch.int32)
    reference.store_index_keys_fp4(keys, pool, loc)
    written = loc >= 0
    want = Q.fp4_round_blocks(Q.hadamard_rotate(keys))
    assert torch.equal(layout.unpack(pool[loc[written].long()]), want[written])
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[loc[written].long()] = False
    assert (pool[untouched] == 7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_pack_store_holds_the_in_place_rounding(device, dtype):
    """The Triton key write stores exactly the values the in-place kernel rounds the same rows to
    (the same rotation and rounding code); padded emissions (-1) write nothing."""
    require_triton()
    from dsv4_kernels import indexer_rotate

    layout = IndexKeyFP4Layout(D)
    x = _spread_rows(45, seed=5).to(dtype).to(device)
    pool = torch.full((64, layout.row_bytes), 9, dtype=torch.uint8, device=device)
    loc = torch.randperm(64, generator=torch.Generator().manual_seed(5))[:45].int()
    loc[[4, 17, 44]] = -1
    loc = loc.to(device)
    assert indexer_rotate.rotate_round_pack_store(x, pool, loc) is pool
    written = loc >= 0
    in_place = indexer_rotate.rope_rotate_round_(x.clone(), rope_dim=0)
    got = layout.unpack(pool[loc[written].long()])
    assert torch.equal(got, in_place.float()[written])  # == : a rotated -0.0 may keep its sign
    untouched = torch.ones(64, dtype=torch.bool, device=device)
    untouched[loc[written].long()] = False
    assert (pool[untouched] == 9).all()
    # against the torch write: the same bytes where the rotation sums came out equal (fp32: all
    # on the interpreter; bf16 there truncates, see test_kernels_indexer_rotate)
    want = reference.store_index_keys_fp4(x.cpu(), torch.full((64, layout.row_bytes), 9, dtype=torch.uint8), loc.cpu())
    same = (want.to(device) == pool).all(-1)
    assert same.float().mean() > (0.95 if dtype == torch.float32 or device == "cuda" else 0.5)
    if device == "cuda":
        assert ops.store_index_keys_fp4(x, torch.zeros_like(pool), loc).equal(torch.where(
            untouched[:, None], torch.zeros_like(pool), pool))


def test_triton_pack_store_refuses_bad_arguments(device):
    require_triton()
    from dsv4_kernels import indexer_rotate

    pool = torch.zeros(8, 68, dtype=torch.uint8, device=device)
    loc = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="power of two"):
        indexer_rotate.rotate_round_pack_store(torch.zeros(2, 96, device=device), pool, loc)
    with pytest.raises(ValueError, match=r"expected uint8 \[N, 68\]"):
        indexer_rotate.rotate_round_pack_store(torch.zeros(2, 128, device=device), pool[:, :64], loc)
    with pytest.raises(ValueError, match="out_loc"):
        indexer_rotate.rotate_round_pack_store(torch.zeros(3, 128, device=device), pool, loc)


def _scoring_case(device, dtype, lengths, NH=8, context=1280, num_rows=3):
    """Rounded q and keys as the release numerics give them; keys both as model-dtype rows and
    packed; candidates read through a page table."""
    g = torch.Generator().manual_seed(len(lengths))
    T = len(lengths)
    rtt = paged_page_table(num_rows, context, device=device, seed=T)
    cands = PageTableList(rtt, torch.randint(0, num_rows, (T,), generator=g).int().to(device), 4, context // 4)
    q = Q.fp4_round_blocks(Q.hadamard_rotate(torch.randn(T, NH, D, generator=g).to(dtype)))
    keys = Q.fp4_round_blocks(Q.hadamard_rotate(
        (torch.randn(num_rows * context // 4, D, generator=g) * torch.rand(num_rows * context // 4, 1, generator=g))
        .to(dtype)))
    w = torch.randn(T, NH, generator=g) / NH  # both signs: some scores are zero or -0.0
    lens = torch.as_tensor(lengths, dtype=torch.int32)
    packed = IndexKeyFP4Layout(D).pack(keys)
    return [t.to(device) for t in (q, w, keys, packed, lens)] + [cands]


LENGTHS = [0, 1, 63, 64, 65, 256, 257, 320, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_scores_packed_keys_bit_for_bit(dtype):
    q, w, keys, packed, lens, cands = _scoring_case("cpu", dtype, LENGTHS)
    a = reference.indexer_logits(q, w, keys, cands, lens)
    b = reference.indexer_logits(q, w, packed, cands, lens)
    assert torch.equal(_bits(a), _bits(b))
    topk = [torch.empty(len(LENGTHS), 64, dtype=torch.int32) for _ in range(2)]
    reference.indexer_topk(q, w, keys, cands, lens, 64, topk[0])
    reference.indexer_topk(q, w, packed, cands, lens, 64, topk[1])
    assert torch.equal(topk[0], topk[1]) and (topk[0][6] >= 0).sum() == 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_scores_packed_keys_bit_for_bit(device, dtype):
    """The kernel decodes each packed tile to q's dtype (exact) and runs the same dot: the same
    logits, bit for bit, as over model-dtype keys holding the same values, so the same top-k."""
    require_triton()
    from dsv4_kernels import indexer

    q, w, keys, packed, lens, cands = _scoring_case(device, dtype, LENGTHS)
    a = indexer.indexer_logits(q, w, keys, cands, lens)
    b = indexer.indexer_logits(q, w, packed, cands, lens)
    assert torch.equal(_bits(a), _bits(b))
    if dtype == torch.float32:  # fp32 dots on both sides: close to the reference's einsum
        torch.testing.assert_close(b, reference.indexer_logits(q, w, packed, cands, lens), rtol=1e-5, atol=1e-5)
    outs = [torch.full((len(LENGTHS), 64), 12345, dtype=torch.int32, device=device) for _ in range(2)]
    indexer.indexer_topk(q, w, keys, cands, lens, 64, outs[0])
    indexer.indexer_topk(q, w, packed, cands, lens, 64, outs[1])
    assert torch.equal(outs[0], outs[1])
    listed = cands.gather(lens)  # a [T, C] list reads the packed pool the same way
    assert torch.equal(_bits(indexer.indexer_logits(q, w, packed, listed, lens)), _bits(b))


def test_a_packed_pool_of_the_wrong_width_is_refused():
    q, w, keys, packed, lens, cands = _scoring_case("cpu", torch.float32, [4])
    with pytest.raises(ValueError, match=r"expected uint8 \[N, 68\]"):
        reference.indexer_logits(q, w, packed[:, :64], cands, lens)
