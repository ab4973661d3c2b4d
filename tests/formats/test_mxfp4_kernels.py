"""The compiled MXFP4 -> e4m3 kernel against the numpy reference, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from mxfp4_checkpoints import e8m0_tensor, fp4_tensor, one_block_tile, random_mxfp4, write_checkpoint

from furlong.core import mxfp4
from furlong.core.formats.mxfp4_convert import ConvertOptions, convert_mxfp4_to_fp8
from furlong.core.formats.mxfp4_kernels import (
    NumbaEncoder,
    NumpyEncoder,
    numba_unavailable_reason,
    select_encoder,
)

pytest.importorskip("numba")


@pytest.fixture(scope="module")
def compiled() -> NumbaEncoder:
    encoder = select_encoder("numba")
    encoder.warm_up()
    yield encoder
    encoder.close()


def encoded(encoder, packed: np.ndarray, check: mxfp4.TileCheck, rows_per_chunk: int) -> np.ndarray:
    """All chunks concatenated (copied: a compiled chunk is only valid until the next one)."""
    chunks, expected_start = [], 0
    for start, chunk in encoder.encode_fp8(packed, check, rows_per_chunk):
        assert start == expected_start
        chunks.append(chunk.copy())
        expected_start += chunk.shape[0]
    return np.concatenate(chunks) if chunks else np.empty((0, packed.shape[-1] * 2), np.uint8)


def assert_same_check(got: mxfp4.TileCheck, want: mxfp4.TileCheck) -> None:
    assert np.array_equal(got.tile_bmax, want.tile_bmax)
    assert got.tile_bmax.shape == want.tile_bmax.shape
    assert np.array_equal(got.block_spread, want.block_spread)
    assert got.block_spread.shape == want.block_spread.shape
    assert (got.num_lossy_tiles, got.lossy) == (want.num_lossy_tiles, want.lossy)


def assert_same_bytes(
    compiled: NumbaEncoder, packed: np.ndarray, scales: np.ndarray, rows_per_chunk: int
) -> np.ndarray:
    reference = NumpyEncoder()
    want_check = reference.check_tiles(packed, scales)
    got_check = compiled.check_tiles(packed, scales)
    assert_same_check(got_check, want_check)
    want = encoded(reference, packed, want_check, 64)
    got = encoded(compiled, packed, got_check, rows_per_chunk)
    assert got.dtype == np.uint8 and got.shape == want.shape
    assert np.array_equal(got, want)
    return got


@pytest.mark.unit
def test_exhaustive_codes_times_spreads_match_the_reference(compiled):
    for spread in range(21):
        for code in range(16):
            packed, scales = one_block_tile(code, spread)
            want = mxfp4.check_tiles(packed, scales)
            got = compiled.check_tiles(packed, scales)
            assert_same_check(got, want)
            assert got.exact == (spread <= 14 or code in (0, 8)), (code, spread)
            if not got.exact:
                with pytest.raises(ValueError, match="not exactly representable"):
                    next(iter(compiled.encode_fp8(packed, got, 128)))
                continue
            fp8 = assert_same_bytes(compiled, packed, scales, 128)
            if code in (0, 8):
                assert (fp8[0, :32] == (0x80 if code == 8 else 0)).all(), (code, spread)


@pytest.mark.unit
@pytest.mark.parametrize(
    "shape, rows_per_chunk",
    [
        ((1, 32), 1),
        ((127, 96), 5),
        ((129, 160), 64),
        ((200, 4128 // 2 * 2), 7),
        ((3, 200, 96), 33),
        ((2, 2, 130, 64), 1000),
        ((0, 64), 4),
        ((3, 0, 64), 4),
    ],
)
def test_random_shapes_and_tails_match_the_reference(compiled, shape, rows_per_chunk):
    rng = np.random.default_rng(sum(shape) + rows_per_chunk)
    packed, scales = random_mxfp4(rng, shape, top=130, max_spread=14)
    assert_same_bytes(compiled, packed, scales, rows_per_chunk)


@pytest.mark.unit
def test_deep_zero_blocks_and_every_spread_match_the_reference(compiled):
    """Spreads 0..20 all over a tensor; blocks deeper than 14 octaves hold only +-0 codes, so the
    tensor is exact and the clipped-spread row of the table is used."""
    rng = np.random.default_rng(23)
    rows, cols = 300, 416
    codes = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
    scales = (150 - rng.integers(0, 21, (rows, cols // 32))).astype(np.uint8)
    scales[::128, ::4] = 150
    deep = np.repeat(150 - scales.astype(np.int64) > 14, 32, axis=1)
    codes[deep] &= 0x08
    fp8 = assert_same_bytes(compiled, mxfp4.pack_codes(codes), scales, 17)
    assert deep.any() and (fp8[deep] == 0x80).any() and (fp8[deep] == 0).any()


@pytest.mark.unit
def test_lossy_tiles_and_nan_scales_are_reported_as_the_reference_does(compiled):
    rng = np.random.default_rng(31)
    packed, scales = random_mxfp4(rng, (2, 256, 512), top=140, max_spread=20)
    want = mxfp4.check_tiles(packed, scales)
    assert want.num_lossy_tiles > 8
    assert_same_check(compiled.check_tiles(packed, scales), want)
    scales[1, 200, 9] = 255
    with pytest.raises(ValueError) as reference_error:
        mxfp4.check_tiles(packed, scales)
    with pytest.raises(ValueError) as compiled_error:
        compiled.check_tiles(packed, scales)
    assert str(compiled_error.value) == str(reference_error.value)
    assert "(1, 200, 9)" in str(compiled_error.value)
    with pytest.raises(ValueError, match="needs 16 scales"):
        compiled.check_tiles(packed, scales[..., :15])


@pytest.mark.unit
def test_an_abandoned_encoding_leaves_the_encoder_usable(compiled):
    rng = np.random.default_rng(41)
    packed, scales = random_mxfp4(rng, (512, 256))
    check = compiled.check_tiles(packed, scales)
    chunks = compiled.encode_fp8(packed, check, 16)
    next(chunks)
    chunks.close()
    assert_same_bytes(compiled, packed, scales, 16)


@pytest.mark.unit
def test_kernel_selection():
    assert numba_unavailable_reason() is None
    assert select_encoder("numpy").name == "numpy"
    assert select_encoder("auto").name == "numba"
    with pytest.raises(ValueError, match="'cuda'"):
        select_encoder("cuda")
    with pytest.raises(ValueError, match="'cuda'"):
        ConvertOptions(kernel="cuda")
    with pytest.raises(ValueError, match="chunk_bytes 0"):
        ConvertOptions(chunk_bytes=0)


@pytest.mark.integration
def test_both_kernels_write_identical_checkpoints(tmp_path):
    rng = np.random.default_rng(53)
    weights, scales = {}, {}
    for i, shape in enumerate([(384, 512), (3, 130, 96), (1, 64)]):
        packed, sc = random_mxfp4(rng, shape, top=125)
        weights[f"model.layers.{i}.mlp.experts.w.weight"] = fp4_tensor(packed)
        scales[f"model.layers.{i}.mlp.experts.w.scale"] = e8m0_tensor(sc)
    src = write_checkpoint(
        tmp_path / "src",
        {"model-00001-of-00002.safetensors": weights, "model-00002-of-00002.safetensors": scales},
    )
    outputs = {}
    for kernel, chunk_bytes in (("numpy", 4 << 20), ("numba", 1000)):
        dst = tmp_path / kernel
        convert_mxfp4_to_fp8(src, dst, ConvertOptions(kernel=kernel, chunk_bytes=chunk_bytes))
        outputs[kernel] = {p.name: p.read_bytes() for p in dst.iterdir()}
    assert outputs["numpy"].keys() == outputs["numba"].keys()
    for name in outputs["numpy"]:
        assert outputs["numpy"][name] == outputs["numba"][name], name


@pytest.mark.integration
@pytest.mark.parametrize("kernel", ["numba", "numpy"])
def test_a_bad_weight_after_good_ones_fails_the_conversion(tmp_path, kernel):
    """Weights are read and checked one ahead of the writer; a NaN scale in the second weight must
    still fail the whole conversion, name that weight, and leave nothing behind."""
    rng = np.random.default_rng(61)
    weights, scales = {}, {}
    for i in range(3):
        packed, sc = random_mxfp4(rng, (256, 256))
        if i == 1:
            sc[130, 3] = 255
        weights[f"w{i}.weight"] = fp4_tensor(packed)
        scales[f"w{i}.scale"] = e8m0_tensor(sc)
    src = write_checkpoint(
        tmp_path / "src",
        {"model-00001-of-00002.safetensors": weights, "model-00002-of-00002.safetensors": scales},
    )
    with pytest.raises(ValueError, match=r"'w1.weight'.*NaN.*\(0, 130, 3\)"):
        convert_mxfp4_to_fp8(src, tmp_path / "dst", ConvertOptions(kernel=kernel))
    assert not (tmp_path / "dst").exists() and not list(tmp_path.glob(".dst.partial-*"))
