"""NVFP4 in ModelOpt's layout: nibble order, the E2M1 table, quantisation error and idempotence."""
import torch

from beamc.checkpoint import nvfp4

# The E2M1 format, written out independently of the module: codes 0-7 positive, 8-15 the same magnitudes negated.
FORMAT = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (7, 64), generator=g, dtype=torch.uint8)
    packed = nvfp4.pack_codes(codes)
    assert packed.shape == (7, 32) and packed.dtype == torch.uint8
    assert torch.equal(nvfp4.unpack_codes(packed), codes)


def test_even_column_in_low_nibble():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)
    assert nvfp4.pack_codes(codes).tolist() == [[0x21, 0x8F]]
    assert nvfp4.unpack_codes(torch.tensor([[0x21, 0x8F]], dtype=torch.uint8)).tolist() == [[1, 2, 15, 8]]


def test_every_code_dequantises_to_table_times_scales():
    # two rows x two groups of 16: every code appears in every group, each group with its own scale
    codes = torch.arange(16, dtype=torch.uint8).repeat(2, 2)
    scale = torch.tensor([[1.5, 0.25], [448.0, 0.015625]]).to(torch.float8_e4m3fn)
    scale_2 = torch.tensor(0.0123, dtype=torch.float32)
    out = nvfp4.dequantize(nvfp4.pack_codes(codes), scale, scale_2, torch.float32)
    for r in range(2):
        for c in range(32):
            want = torch.tensor(FORMAT[c % 16]) * scale[r, c // 16].float() * scale_2
            assert out[r, c].item() == want.item(), (r, c)
            assert torch.signbit(out[r, c]) == (c % 16 >= 8)  # code 8 is -0
    assert nvfp4.dequantize(nvfp4.pack_codes(codes), scale, scale_2, torch.bfloat16).dtype == torch.bfloat16


def test_round_to_nearest_even_and_saturation():
    x = torch.tensor([0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, 100.0, -0.75, -0.1, -0.0])
    want = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -1.0, -0.0, -0.0]
    got = [FORMAT[c] for c in nvfp4.round_e2m1(x).tolist()]
    assert got == want
    assert nvfp4.round_e2m1(torch.tensor([-0.1, -0.0])).tolist() == [8, 8]  # negatives keep the sign bit


def test_quantize_error_bounded_and_idempotent():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 256, generator=g) * 0.02).to(torch.bfloat16)
    packed, scale, scale_2 = nvfp4.quantize(w)
    assert (packed.shape, packed.dtype) == ((64, 128), torch.uint8)
    assert (scale.shape, scale.dtype) == ((64, 16), torch.float8_e4m3fn)
    assert scale_2.shape == () and scale_2.dtype == torch.float32
    assert scale_2.item() == torch.tensor(w.float().abs().max().item() / (6 * 448), dtype=torch.float32).item()

    d = nvfp4.dequantize(packed, scale, scale_2)
    err = (d - w.float()).abs().view(64, 16, 16)
    block_amax = w.float().abs().view(64, 16, 16).amax(-1, keepdim=True)
    # worst case: half the 4..6 gap (1 unit of scale) with the e4m3 scale rounded up by at most 2^-4
    assert (err <= block_amax * (1.0625 / 6) + 1e-12).all()
    assert ((d - w.float()).norm() / w.float().norm()).item() < 0.12

    p2, s2, g2 = nvfp4.quantize(d)
    assert torch.equal(p2, packed)
    assert torch.equal(s2.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(g2, scale_2)


def test_quantize_zero_matrix():
    packed, scale, scale_2 = nvfp4.quantize(torch.zeros(2, 32))
    assert torch.isfinite(scale.float()).all() and torch.isfinite(scale_2)
    assert torch.equal(nvfp4.dequantize(packed, scale, scale_2), torch.zeros(2, 32))


def test_dequantize_stacked_matches_per_matrix_dequantize():
    """A stack of E experts, each the concatenation of `parts` separately quantised matrices (gate and up), in the
    graph's layout: scale_2 [E, parts] gives each block of rows its own global scale."""
    g = torch.Generator().manual_seed(2)
    E, N, K = 3, 8, 64
    for parts in (1, 2):
        mats = [[(torch.randn(N, K, generator=g) * 10 ** (e - j)).to(torch.bfloat16) for j in range(parts)]
                for e in range(E)]
        q = [[nvfp4.quantize(m) for m in row] for row in mats]  # (packed, scale, scale_2) per matrix
        packed = torch.stack([torch.cat([x[0] for x in row]) for row in q])
        scale = torch.stack([torch.cat([x[1] for x in row]) for row in q])
        scale_2 = torch.stack([torch.stack([x[2] for x in row]) for row in q])
        assert (packed.shape, scale.shape, scale_2.shape) == ((E, parts * N, K // 2), (E, parts * N, K // 16),
                                                              (E, parts))
        want = torch.stack([torch.cat([nvfp4.dequantize(*x) for x in row]) for row in q])
        got = nvfp4.dequantize_stacked(packed, scale, scale_2)
        assert got.dtype == torch.float32 and torch.equal(got, want)
        assert len({x[2].item() for row in q for x in row}) == E * parts  # the global scales all differ
