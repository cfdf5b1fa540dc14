"""Rendering of the het-job script: pinned by a golden file, and safe for shell-hostile
run names and paths (the values reach the shell and sbatch exactly as given)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from prime_hpc.config.compose import compose
from prime_hpc.inference import server as srv
from prime_hpc.launcher.plan import After, make_plan, slurm_job_name
from prime_hpc.launcher.render import render_local, render_sbatch, sbatch_quote
from tests.conftest import HOSTILE, REPO, hydra_quote

GOLDEN = REPO / "tests" / "golden" / "rl.sbatch"
GOLDEN_OVERRIDES = [
    "+experiment=reverse_text",
    "cluster=dev",
    "output_dir=/shared/runs/reverse_text",
    "async_level=1",  # generation and training take turns: every group on both cores
    "cluster.account=proj",
    "cluster.qos=high",
    "cluster.constraint=ib",
    "cluster.exclude=node9",
    "cluster.inference.nodes=2",
    "cluster.trainer.nodes=2",
    "cluster.orchestrator.mem_gb=4",
    "cluster.inference.mem_gb=16",
    "cluster.trainer.mem_gb=8",
    'cluster.sbatch_extra=["--mail-type=END"]',
    'cluster.env_setup=["module load cuda"]',
    "cluster.cache_dir=/shared/cache",
]


GOLDEN_SFT = REPO / "tests" / "golden" / "sft.sbatch"


def golden_plan():
    """The RL run of a pipeline: it starts after its warm-up job (afterok)."""
    plan = make_plan(compose(GOLDEN_OVERRIDES), python="/opt/venv/bin/python", cores=[0, 1])
    plan.head_argv = [plan.python, "-u", "-m", "submitit.core._submit", str(plan.run.submitit_dir)]
    plan.after = [After(job_id="41", output_dir="/shared/runs/reverse_text/warmup")]
    return plan


def golden_sft_plan():
    cfg = compose(
        [
            "+experiment=reverse_text_sft",
            "cluster=dev",
            "output_dir=/shared/runs/sft",
            "cluster.cache_dir=null",
            "cluster.trainer.nodes=2",
            "cluster.trainer.nproc_per_node=2",
        ]
    )
    return make_plan(cfg, python="/opt/venv/bin/python", cores=[0, 1])


GOLDENS = [(golden_plan, GOLDEN), (golden_sft_plan, GOLDEN_SFT)]


@pytest.mark.parametrize("plan_fn, golden", GOLDENS)
def test_sbatch_matches_golden_file(plan_fn, golden):
    assert render_sbatch(plan_fn()) == golden.read_text(), (
        f"the rendering of {golden.name} changed; review the difference, then write the goldens anew with "
        "`python -m tests.unit.test_render`"
    )


@pytest.mark.parametrize("cache", ["empty", "kept", "unwritable"])
def test_compiled_templates_render_the_same(tmp_path, monkeypatch, cache):
    """Templates compiled once and kept in the user's cache render what the sources do; a
    cache that cannot be written costs the compile, not the submit."""
    from prime_hpc.core import usercache
    from prime_hpc.launcher import render

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    render._env.cache_clear()
    if cache == "kept":
        render_sbatch(golden_plan())
        render._env.cache_clear()
        assert list((tmp_path / "prime-hpc" / "templates").iterdir())
    if cache == "unwritable":

        def refuse(*_a, **_k):
            raise PermissionError(13, "Read-only file system")

        monkeypatch.setattr(usercache.os, "replace", refuse)
    try:
        assert render_sbatch(golden_plan()) == GOLDEN.read_text()
        if cache == "unwritable":
            assert not list((tmp_path / "prime-hpc" / "templates").iterdir())  # and no temporary file left
    finally:
        render._env.cache_clear()


def test_golden_sft_script_is_a_plain_job_of_the_trainer_only():
    text = GOLDEN_SFT.read_text()
    assert "hetjob" not in text and "--het-group" not in text
    assert "prime_hpc.inference" not in text and "submitit.core._submit" not in text
    assert "-m prime_hpc.trainer.sft" in text and "--nnodes=2 --nproc-per-node=2" in text
    assert "taskset -c 0,1" in text and "OMP_NUM_THREADS=1" in text  # 2 cores, 2 ranks per node
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_golden_script_is_a_three_group_het_job():
    text = GOLDEN.read_text()
    assert text.count("#SBATCH hetjob") == 2
    # inference servers (one step per slot, restartable), router (head node), trainer, head
    assert re.findall(r"srun --het-group=(\d)", text) == ["1", "0", "2", "0"]
    assert "#SBATCH --no-kill\n" in text  # a failed inference node costs only its server
    assert '--relative="$1"' in text and '--job-name="inference_$1"' in text and "--open-mode=append" in text
    # the trainer's ranks meet in files of the run's private rendezvous/, made ready before anything starts
    assert "RDZV_CONF=store_type=file" in text and "PRIME_HPC_PG_STORE=/shared/runs/reverse_text/rendezvous/" in text
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text and "store_type=tcp" not in text
    assert text.index("WHY=$(attempt rendezvous") < text.index("start_inference()")
    assert "--overlap" in text and "router_0.log" in text
    assert "--rdzv-backend=c10d" in text and "--redirects=3 --tee=3" in text
    assert '--log-dir="$LOGS/trainer/torchrun"' in text
    assert "#SBATCH --nodes=2 --ntasks-per-node=1 --cpus-per-task=1\n#SBATCH --no-kill\n#SBATCH --mem=8192M" in text
    assert text.count("#SBATCH --mem=") == 3  # one per group: SLURM would copy one group's to the next
    assert "#SBATCH --dependency=afterok:41\n#SBATCH --kill-on-invalid-dep=yes" in text
    assert "--local-addr=127.0.0.1" in text and "export PRIME_HPC_NODE_ADDRESS=127.0.0.1" in text
    # async_level 1: generation and training take turns, so each runs on both cores
    assert "OMP_NUM_THREADS=2 PRIME_HPC_CPUS=0,1 taskset -c 0,1 /opt/venv/bin/python -u -m prime_hpc.inference" in text
    assert (
        "OMP_NUM_THREADS=2 PRIME_HPC_CPUS=0,1 taskset -c 0,1 /opt/venv/bin/python -u -m torch.distributed.run" in text
    )
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_a_real_cluster_meets_in_files_of_the_runs_private_directory_not_at_a_port():
    """Several nodes: torchrun's agents and the trainer's ranks meet in file stores of the
    run's `rendezvous/` on the shared filesystem, as on one host: no TCP store at a port that
    was free a moment before, which whoever took it meanwhile would serve."""
    cfg = compose(
        ["+experiment=reverse_text", "cluster=slurm", "output_dir=/shared/runs/rt", "cluster.trainer.nodes=2"]
    )
    text = render_sbatch(make_plan(cfg, python="/opt/venv/bin/python"))
    assert re.findall(r"srun --het-group=(\d)", text) == ["1", "0", "2", "0"]  # no probe of a free port
    assert "--nnodes=2" in text and "store_type=tcp" not in text and "--local-addr" not in text
    assert "RDZV=/shared/runs/rt/rendezvous/trainer_rendezvous.store; RDZV_CONF=store_type=file" in text
    assert "PRIME_HPC_PG_STORE=/shared/runs/rt/rendezvous/trainer_process_group.store" in text
    assert 'WHY=$(attempt rendezvous 2>&1 >/dev/null) || { record 1 trainer "${WHY#prime-hpc: }"' in text


OTHER_UID = 65534  # nobody: "another user" (the tests run as root)


def _rendezvous(run_dir, capsys) -> tuple[int, str, str]:
    from prime_hpc.job import attempt

    rc = attempt.main(["rendezvous", str(run_dir), "--job-id", "7"])
    out, err = capsys.readouterr()
    return rc, out.strip(), err.strip()


def test_the_rendezvous_directory_is_the_users_alone_and_fresh_for_each_attempt(tmp_path, capsys):
    """`attempt rendezvous` (the job script's line before anything starts) makes the run's
    `rendezvous/` 0700 and empties it of an earlier attempt's stores; one of the user's
    that others could read is narrowed to 0700."""
    import os
    import stat

    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    rc, out, err = _rendezvous(run, capsys)
    d = run / "rendezvous"
    assert (rc, out, err) == (0, str(d), "") and stat.S_IMODE(d.stat().st_mode) == 0o700
    (d / "trainer_rendezvous.store").write_bytes(b"an earlier attempt's state")
    (d / "weights_ab12.store").write_bytes(b"")
    os.chmod(d, 0o755)
    assert _rendezvous(run, capsys)[0] == 0
    assert list(d.iterdir()) == [] and stat.S_IMODE(d.stat().st_mode) == 0o700


@pytest.mark.parametrize("planted", ["directory", "store", "link"])
def test_a_rendezvous_directory_or_store_planted_by_another_user_is_refused_in_one_line(tmp_path, capsys, planted):
    """Another user's `rendezvous/` (made before the run's, where the run's directory let
    them), a store of theirs in it, or a link to a directory of theirs: the attempt meets
    in none of them; one line names it, and nothing of it is removed."""
    import os

    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    d = run / "rendezvous"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, OTHER_UID)
    if planted == "directory":
        d.mkdir(mode=0o777)
        os.chown(d, OTHER_UID, OTHER_UID)
        named, why = d, "belongs to nobody, not to you"
    elif planted == "store":
        d.mkdir(mode=0o700)
        (d / "trainer_rendezvous.store").write_bytes(b"theirs")
        os.chown(d / "trainer_rendezvous.store", OTHER_UID, OTHER_UID)
        named, why = d / "trainer_rendezvous.store", "belongs to nobody, not to you"
    else:
        d.symlink_to(theirs)
        named, why = d, "is a symbolic link"
    rc, out, err = _rendezvous(run, capsys)
    assert rc == 1 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"prime-hpc: the trainer's rendezvous: {named} {why};") and err.endswith("remove it"), err
    assert os.path.lexists(named)


def test_hostile_values_survive_quoting(tmp_path):
    out = tmp_path / HOSTILE
    cfg = compose(
        [
            "+experiment=reverse_text",
            "cluster=dev",
            f"output_dir={hydra_quote(str(out))}",
            f"name={hydra_quote(HOSTILE)}",
            f"cluster.cache_dir={hydra_quote(str(out))}",
        ]
    )
    plan = make_plan(cfg, python="/opt/venv/bin/python")
    plan.head_argv = [plan.python, "-m", "x", str(plan.run.submitit_dir)]
    for text in (render_sbatch(plan), render_local(plan, "local-1")):
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)
        # the exported values, evaluated by bash, are exactly the originals
        exports = "\n".join(ln for ln in text.splitlines() if ln.startswith("export "))
        env = subprocess.run(
            ["bash", "-c", exports + '\nprintf %s "$PRIME_HPC_CACHE"'],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            check=True,
        )
        assert env.stdout == str(out)
    assert not (tmp_path / "PWNED").exists()
    assert re.fullmatch(r"[A-Za-z0-9._-]+", slurm_job_name(HOSTILE))


@pytest.mark.parametrize("value", ["plain", "a b", "it's", 'say "hi"', "back\\slash", "$(x) `y`; z"])
def test_sbatch_quote_roundtrip(value):
    """What sbatch's #SBATCH parser makes of the quoted value (double quotes group,
    backslash escapes): reproduced here to pin the rule the dev-cluster test checks live."""
    quoted = sbatch_quote(value)
    out, esc, inq = [], False, False
    for ch in quoted:
        if esc:
            out.append(ch)
            esc = False
        elif ch == "\\":
            esc = True
        elif ch == '"':
            inq = not inq
        else:
            assert inq or not ch.isspace()
            out.append(ch)
    assert "".join(out) == value


# ----------------------------------------------------------------------------- on GPUs
GPU_OVERRIDES = [  # the 0.6B reverse-text recipe on a GPU cluster: warm-up (SFT) then RL
    "+experiment=reverse_text",
    "model=qwen3_0_6b",
    "cluster=slurm",
    "cluster.device=cuda",
    "output_dir=/shared/runs/rt06",
    "cluster.cache_dir=/shared/cache",
]
GOLDEN_GPU = REPO / "tests" / "golden" / "rl_gpu.sbatch"
GOLDEN_GPU_WARMUP = REPO / "tests" / "golden" / "sft_gpu.sbatch"


def gpu_plans(transport: str = "filesystem"):
    """(warm-up plan, run plan) of the GPU recipe, and (warm-up config, run config)."""
    from prime_hpc.config.pipeline import compose_stages

    warm, run = compose_stages([*GPU_OVERRIDES, f"weights.transport={transport}"])
    plans = [make_plan(c, python="/opt/venv/bin/python") for c in (warm, run)]
    plans[1].head_argv = [plans[1].python, "-u", "-m", "submitit.core._submit", str(plans[1].run.submitit_dir)]
    plans[1].after = [After(job_id="41", output_dir=str(warm.output_dir))]
    return plans, (warm, run)


@pytest.mark.parametrize("transport", ["filesystem", "broadcast"])
def test_the_gpu_recipe_renders_gpu_placement_nccl_and_cuda_vllm(transport, monkeypatch):
    """`+experiment=reverse_text model=qwen3_0_6b cluster=slurm cluster.device=cuda`, line by
    line, for both weight transports: the warm-up trains the 0.6B model on a GPU node; the
    RL job places 8 GPUs per inference and trainer node (none on the head), runs torchrun
    with one rank per GPU over NCCL, and the servers start CUDA vLLM in bf16 ("auto": the
    model's dtype) with one engine per GPU, the broadcast servers with vLLM's NCCL weight
    transfer. The scripts do not depend on the transport (it is in the components' configs)."""
    from prime_hpc.config.component import InferenceRunConfig, component_config, typed
    from prime_hpc.core.device import dist_backend

    (warm_plan, run_plan), (warm, run) = gpu_plans(transport)
    warm_script, run_script = render_sbatch(warm_plan), render_sbatch(run_plan)
    assert warm_script == GOLDEN_GPU_WARMUP.read_text() and run_script == GOLDEN_GPU.read_text(), (
        "the GPU rendering changed; review the difference, then write the goldens anew with "
        "`python -m tests.unit.test_render`"
    )
    lines = run_script.splitlines()
    assert lines.count("#SBATCH --gpus-per-node=8") == 2  # inference and trainer groups; the head has none
    assert "export PRIME_HPC_DEVICE=cuda" in lines and "--nproc-per-node=8" in run_script
    assert "#SBATCH --dependency=afterok:41" in lines  # after its warm-up
    assert warm.model.name == "Qwen/Qwen3-0.6B" and "#SBATCH --gpus-per-node=8" in warm_script
    assert run.model.name == "/shared/runs/rt06/warmup" and dist_backend(run.cluster.device) == "nccl"
    # the servers: CUDA vLLM, bf16 from the model, data parallel over the node's GPUs
    inf = typed(InferenceRunConfig, component_config(run, "inference"), "inference")
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    argv = srv.vllm_args(inf, "/shared/runs/rt06/warmup/weights/step_9", "10.0.0.5")
    assert argv[argv.index("--dtype") + 1] == "auto" and argv[argv.index("--data-parallel-size") + 1] == "8"
    assert argv[argv.index("--host") + 1] == "10.0.0.5"
    transfer = [argv[i + 1] for i, a in enumerate(argv) if a == "--weight-transfer-config"]
    assert transfer == ([json.dumps({"backend": "nccl"})] if transport == "broadcast" else [])
    env = srv.engine_env(inf)
    assert not [k for k in env if k.startswith("VLLM_CPU")], env  # nothing of the CPU build


if __name__ == "__main__":  # write the goldens from today's rendering (after reviewing the change)
    for plan_fn, golden in GOLDENS:
        golden.write_text(render_sbatch(plan_fn()))
        print(f"wrote {golden}")
    (_warm, _run), _cfgs = gpu_plans()
    for _plan, golden in ((_warm, GOLDEN_GPU_WARMUP), (_run, GOLDEN_GPU)):
        golden.write_text(render_sbatch(_plan))
        print(f"wrote {golden}")
