"""An export lands whatever exists of its path: the transformers engine's and PEFT's exports are written beside the
target and published by rename, and a run that saved no checkpoint may never have made the target's parent."""
from __future__ import annotations


def test_an_export_into_a_path_whose_parent_does_not_exist_yet_is_written(tmp_path):
    from adapter.train.export import _written_by_rank0

    def write(d):
        d.mkdir()
        (d / "config.json").write_text("{}")

    out = tmp_path / "outputs" / "run" / "export"
    _written_by_rank0(out, 0, "hf", write)
    assert (out / "config.json").read_text() == "{}"
    assert [p.name for p in out.parent.iterdir()] == ["export"]  # no staging directory left beside it
