"""MXFP4 decoding rules and the exact FP8 re-encoding, exhaustively over codes and spreads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mxfp4_checkpoints import one_block_tile

from furlong.core import mxfp4

E4M3 = (
    torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).numpy()
)


@pytest.mark.unit
def test_fp4_values_and_nibble_order():
    assert mxfp4.FP4_VALUES.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert np.signbit(mxfp4.FP4_VALUES[8])
    packed = np.array([[0x21, 0xF8]], np.uint8)  # element 0 = low nibble 1, element 1 = high 2
    assert mxfp4.unpack_codes(packed).tolist() == [[1, 2, 8, 15]]
    assert np.array_equal(mxfp4.pack_codes(mxfp4.unpack_codes(packed)), packed)
    scales = np.full((1, 1), 127, np.uint8)
    values = mxfp4.dequantize(np.tile(packed, (1, 8)), scales)
    assert values[0, :4].tolist() == [0.5, 1.0, -0.0, -6.0]


@pytest.mark.unit
def test_e8m0_decoding_by_bits_matches_torch_and_flags_nan():
    raw = np.arange(256, dtype=np.uint8)
    ours = mxfp4.e8m0_to_float32(raw)
    assert np.isnan(ours[255]) and not np.isnan(ours[:255]).any()
    assert np.array_equal(ours[:255].astype(np.float64), np.ldexp(1.0, np.arange(255) - 127))
    theirs = torch.from_numpy(raw).view(torch.float8_e8m0fnu).to(torch.float32).numpy()
    assert np.array_equal(ours[:255], theirs[:255])
    with pytest.raises(ValueError, match="NaN"):
        mxfp4.dequantize(np.zeros((1, 16), np.uint8), np.full((1, 1), 255, np.uint8))
    with pytest.raises(ValueError, match="NaN"):
        mxfp4.check_tiles(np.zeros((1, 16), np.uint8), np.full((1, 1), 255, np.uint8))


@pytest.mark.unit
def test_tile_scale_is_the_largest_block_scale_over_64_built_from_bits():
    for bmax in (0, 1, 6, 7, 100, 127, 254):
        assert float(mxfp4.tile_scale_float32(np.array([bmax]))[0]) == 2.0 ** (bmax - 127 - 6)


@pytest.mark.unit
def test_exhaustive_codes_times_spreads():
    """All 16 codes x spreads 0..20: exact iff spread <= 14 or the code is +-0; lossy refused."""
    for spread in range(21):
        for code in range(16):
            packed, scales = one_block_tile(code, spread)
            check = mxfp4.check_tiles(packed, scales)
            should_be_exact = spread <= 14 or code in (0, 8)
            assert check.exact == should_be_exact, (code, spread)
            want = mxfp4.dequantize(packed, scales)
            if not should_be_exact:
                with pytest.raises(ValueError, match="not exactly representable"):
                    mxfp4.to_fp8(packed, scales)
                # the refusal is needed: casting directly loses at least the 0.5 code
                direct = torch.tensor(0.5 * 2.0 ** (6 - spread)).to(torch.float8_e4m3fn)
                assert float(direct) != 0.5 * 2.0 ** (6 - spread)
                continue
            fp8, tile_scale = mxfp4.to_fp8(packed, scales)
            got = E4M3[fp8] * float(tile_scale[0, 0])
            assert np.array_equal(got, want), (code, spread)
            assert np.array_equal(np.signbit(got), np.signbit(want)), (code, spread)


@pytest.mark.unit
def test_fast_and_table_paths_agree_with_torch_cast():
    rng = np.random.default_rng(7)
    packed = rng.integers(0, 256, (64, 256), dtype=np.uint8)
    scales = (100 - rng.integers(0, 15, (64, 16))).astype(np.uint8)
    scales[0, 0] = 100
    fp8, tile_scale = mxfp4.to_fp8(packed, scales)
    spread = 100 - scales.astype(np.int64)
    values = mxfp4.FP4_VALUES[mxfp4.unpack_codes(packed)] * np.exp2(6 - np.repeat(spread, 32, axis=1))
    reference = torch.from_numpy(values.astype(np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(fp8, reference)
    assert (spread > 11).any() and (spread <= 11).any()  # both code paths ran


@pytest.mark.unit
def test_lossy_tile_is_named_with_its_block():
    packed, scales = one_block_tile(code=3, spread=17)
    big_packed = np.zeros((256, 128), np.uint8)  # 256 x 256 codes
    big_scales = np.full((256, 8), 140, np.uint8)
    big_packed[128:, 64:128], big_scales[128:, 4:8] = packed, scales
    check = mxfp4.check_tiles(big_packed, big_scales)
    assert check.num_lossy_tiles == 1
    tile = check.lossy[0]
    assert (tile.tile_row, tile.tile_col, tile.spread_octaves) == (1, 1, 17)
    assert (tile.block_row, tile.block_col) == (128, 4)
    assert "tile (1, 1)" in tile.describe() and "17 octaves" in tile.describe()


@pytest.mark.unit
def test_shapes_that_do_not_fill_tiles_and_stacked_experts():
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, (3, 200, 48), dtype=np.uint8)  # 3 experts, 200 x 96
    scales = (90 - rng.integers(0, 15, (3, 200, 3))).astype(np.uint8)
    fp8, tile_scales = mxfp4.to_fp8(packed, scales)
    assert fp8.shape == (3, 200, 96) and tile_scales.shape == (3, 2, 1)
    for e in range(3):
        factors = np.repeat(np.repeat(tile_scales[e].astype(np.float64), 128, 0), 128, 1)
        assert np.array_equal(E4M3[fp8[e]] * factors[:200, :96], mxfp4.dequantize(packed[e], scales[e]))
    with pytest.raises(ValueError, match="needs 3 scales"):
        mxfp4.check_tiles(packed, scales[..., :2])
