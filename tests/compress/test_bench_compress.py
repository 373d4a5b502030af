"""`kvq bench compress` pieces that can be checked without timing anything: the I/O floor's output sizes."""

from __future__ import annotations

from kvq.bench.compress import Row, io_floor, render


def test_io_floor_reads_inputs_and_writes_the_output_sizes(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "src" / "a.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "src" / "b.safetensors").write_bytes(b"y" * 10)
    io_floor(str(tmp_path / "src"), str(tmp_path / "out"), {"a.safetensors": 300, "b.safetensors": 70}, 2)
    assert (tmp_path / "out" / "a.safetensors").stat().st_size == 300
    assert (tmp_path / "out" / "b.safetensors").stat().st_size == 70


def test_render_states_the_targets():
    rows = [
        Row("kvq compress", 10.0, 2 * 10**9, 10**9, 0),
        Row("model_free", 40.0, 5 * 10**9, 10**9, 0),
        Row("floor", 6.0, 10**8, 10**9, 0),
    ]
    table = render(rows, 2)
    assert (
        "4.0x faster" in table.caption
        and "0.40x its peak RSS" in table.caption
        and "1.67x the I/O" in table.caption
    )
