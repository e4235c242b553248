"""`nd-adapter calibrate` on CPU: a fake benchmark backend with known rates; the fits must recover them, and the
written profile must be what `plan` then predicts with."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from adapter import config
from adapter.cli import main as cli_main
from adapter.errors import UserError
from adapter.models import counts
from adapter.models.arch import load_arch
from adapter.plan import calibrate, hardware, timing

ROOT = Path(__file__).resolve().parents[2]
CFG = ROOT / "bench/configs/llama-3.2-1b-dp2.yaml"
R, C, A, S0, HBM, BW, LAT = 700e12, 96.0, 400e12, 1504.0, 3e12, 2e11, 2e-5


class FakeBench:
    """Times computed from the profile's own laws with known parameters (what a GPU would have measured)."""

    device = "Fake GPU"

    def __init__(self, world: int = 1, nodes: int = 1, rank: int = 0):
        self.world, self.nodes, self.rank, self.calls = world, nodes, rank, []

    def gemm(self, m, n, k, iters):
        self.calls.append(("gemm", m, n, k))
        return 2 * m * n * k / (R * math.prod(d / (d + C) for d in (m, n, k)))

    def attention(self, batch, seq, heads, kv_heads, head_dim, iters):
        self.calls.append(("attention", batch, seq, heads, kv_heads))
        return timing.ATTN_FWD_BWD * 4 * batch * seq * seq * heads * head_dim / 2 / (A * seq / (seq + S0))

    def copy(self, nbytes, iters):
        return 2 * nbytes / HBM

    def collective(self, op, nbytes, iters):
        self.calls.append((op, nbytes))
        factor = 2.0 if op == "all_reduce" else 1.0
        return LAT + factor * (self.world - 1) / self.world * nbytes / BW


def args(out, **kw):
    return argparse.Namespace(config=str(CFG), out=str(out), base=kw.get("base"), iters=kw.get("iters", 2),
                              set=kw.get("set"), model=None, nodes=None, gpus_per_node=None, gpu=None)


def test_fits_recover_the_rates_and_the_model_shapes():
    cfg = config.load(CFG)
    arch = load_arch(cfg.model.path)
    bench = FakeBench(world=2)
    prof = calibrate.calibrate(cfg, arch, bench, hardware.read("h200"))
    assert prof.gemm.max_flops == pytest.approx(R, rel=1e-9) and prof.gemm.half_dim == C
    assert prof.attention.max_flops == pytest.approx(A, rel=1e-9) and prof.attention.half_seq == S0
    assert prof.hbm_bytes_per_s == pytest.approx(HBM)
    h200 = hardware.read("h200")
    assert prof.elementwise_bytes_per_s == pytest.approx(h200.elementwise_bytes_per_s * HBM / h200.hbm_bytes_per_s)
    assert prof.intra_node.busbw == pytest.approx(BW) and prof.intra_node.latency_s == pytest.approx(LAT)
    assert prof.inter_node == h200.inter_node and prof.host == h200.host           # not measured: kept
    # the model's GEMMs (micro-batch 2 × seq 4096 = 8192 tokens, tp 1) and its heads were what got measured
    gemms = {c[1:] for c in bench.calls if c[0] == "gemm"}
    assert set(counts.layer_gemms(arch, 8192, 1)) <= gemms and (8192, 128256, 2048) in gemms
    assert {c[2] for c in bench.calls if c[0] == "attention"} == {1024, 2048, 4096}
    assert {c[3:] for c in bench.calls if c[0] == "attention"} == {(32, 8)}
    assert {c[0] for c in bench.calls} >= {"all_gather", "reduce_scatter", "all_reduce"}
    assert len(prof.measurements["gemm"]) == len(gemms) and "collectives" in prof.measurements
    assert "calibrate on Fake GPU" in prof.sources["gemm"] and prof.name == "calibrated-fake-gpu"


def test_across_nodes_the_network_is_per_gpu():
    cfg = config.load(CFG)
    prof = calibrate.calibrate(cfg, load_arch(cfg.model.path), FakeBench(world=8, nodes=2), hardware.read("h100"))
    assert prof.inter_node.busbw_per_gpu == pytest.approx(BW / 4)
    assert prof.intra_node == hardware.read("h100").intra_node


def test_written_profile_is_what_plan_predicts_with(tmp_path):
    out = tmp_path / "fake.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert calibrate.main(args(out), {}, bench=FakeBench()) == 0
    assert "Use it: --set hardware.profile=" in printed.getvalue()
    assert json.loads(out.read_text())["gemm"]["half_dim"] == C
    assert [p.name for p in tmp_path.iterdir()] == ["fake.json"]               # no temp file left behind
    outs = {}
    for ref in ("h200", str(out)):
        so, se = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
            code = cli_main(["plan", str(CFG), "--format", "json", "--set", f"hardware.profile={ref}"])
        assert code == 0, se.getvalue()
        outs[ref] = json.loads(so.getvalue())["predicted"]
    assert outs[str(out)]["profile"] == str(out) and outs["h200"]["profile"] == "h200"
    assert outs[str(out)]["tokens_per_s_per_gpu"] < outs["h200"]["tokens_per_s_per_gpu"]   # 700 < 808 TFLOP/s
    other = tmp_path / "rank1.json"
    calibrate.main(args(other), {}, bench=FakeBench(world=2, rank=1))
    assert not other.exists()                                                   # only rank 0 writes


def test_refusals_are_one_line(tmp_path):
    with pytest.raises(UserError, match="--out=.*its directory does not exist"):
        calibrate.main(args(tmp_path / "missing" / "p.json"), {}, bench=FakeBench())
    with pytest.raises(UserError, match="--iters=0"):
        calibrate.main(args(tmp_path / "p.json", iters=0), {}, bench=FakeBench())
    with pytest.raises(UserError, match="--base='nope'"):
        calibrate.main(args(tmp_path / "p.json", base="nope"), {}, bench=FakeBench())
    err = io.StringIO()
    with contextlib.redirect_stderr(err):                                      # no CUDA here: the real backend
        code = cli_main(["calibrate", str(CFG), "--out", str(tmp_path / "p.json")])
    assert code == 2 and "run it on the GPU machine" in err.getvalue() and len(err.getvalue().splitlines()) == 1
    assert not (tmp_path / "p.json").exists()


def test_fit_helpers_by_hand():
    assert calibrate.fit_link([(1e9, 0.01 + 1e-5), (2e9, 0.02 + 1e-5)]) == pytest.approx((1e11, 1e-5))
    bw, lat = calibrate.fit_link([(1e9, 0.01), (2e9, 0.025)])                  # negative intercept: through 0
    assert lat == 0.0 and bw == pytest.approx((1e18 + 4e18) / (1e9 * 0.01 + 2e9 * 0.025))
    rmax, c, err = calibrate.fit_saturating([((64,), 50.0), ((192,), 75.0)], [0.0, 64.0, 128.0])
    assert (rmax, c) == pytest.approx((100.0, 64.0)) and err == pytest.approx(0.0, abs=1e-12)
