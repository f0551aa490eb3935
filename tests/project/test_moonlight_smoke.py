"""examples/moonlight/smoke.py --dry-run, as CI can run it (no GPU, no Megatron-Bridge): the scaled-down
Moonlight with the real routing settings, its prior, both runs' configurations, and the prerequisites named."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from rpb.prior.artifact import read_metadata

SMOKE = Path(__file__).resolve().parents[2] / "examples" / "moonlight" / "smoke.py"


def test_the_dry_run_builds_the_inputs_validates_both_runs_and_names_what_is_missing(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("moonlight_smoke", SMOKE)
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    assert smoke.main(["--work", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "rpb: configuration OK" in out and "kl-to-base: configuration OK" in out
    missing = out.split("prerequisites missing here: ")[1].strip()
    assert missing == (", ".join(smoke.missing_prerequisites()) or "none")
    assert "megatron-bridge" in missing  # the test environment has none: the dry run must say so
    # Moonlight-16B-A3B's routing, as its published config.json gives it
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["n_routed_experts"], config["num_experts_per_tok"]) == ("deepseek_v3", 64, 6)
    assert (config["n_group"], config["topk_group"], config["n_shared_experts"]) == (1, 1, 2)
    assert config["routed_scaling_factor"] == 2.446 and config["first_k_dense_replace"] == 1
    meta = read_metadata(tmp_path / "prior.safetensors")
    assert meta["top_k"] == 6 and meta["num_experts"] == 64 and meta["num_rows"] == 64
    assert meta["moe_layers"] == [1, 2, 3]
