"""Helpers for the trainer tests: the trainer's YAML as the launcher writes it, torchrun in
a subprocess, and a stand-in orchestrator that writes real rollout files (sampled from a
real policy, scored with the reverse-text reward) through `prime_hpc.rundir.batch`."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional, Sequence

from prime_hpc.config.component import write_component_config
from prime_hpc.config.compose import compose
from prime_hpc.rundir import RunDir, batch, wait_stable

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "reverse_text"


def trainer_yaml(output_dir: Path, overrides: Sequence[str]) -> Path:
    """Compose the run and write `<output_dir>/configs/trainer.yaml` as submit does."""
    cfg = compose([f"output_dir={output_dir}", *overrides])
    return write_component_config(cfg, "trainer")


def child_env(extra: Optional[dict] = None) -> dict:
    """The environment of a trainer subprocess: this checkout first on the path (so a
    fresh clone tests itself), no network."""
    path = os.pathsep.join([str(REPO), str(EXAMPLES), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "offline",
        **(extra or {}),
    }


def trainer_cmd(module: str, config: Path, nproc: int = 2) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", module, "--config", str(config)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        "--config",
        str(config),
    ]


def run_trainer(
    module: str, config: Path, nproc: int = 2, env: Optional[dict] = None, timeout: float = 900
) -> subprocess.CompletedProcess:
    return subprocess.run(
        trainer_cmd(module, config, nproc),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(env),
        cwd=str(config.parent),
    )


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"


# ----------------------------------------------------------------------------- stand-in orchestrator
def load_policy(policy_dir: Path, base_dir: Optional[Path] = None):
    """The HF model in `policy_dir`; a directory holding only an adapter (`adapter/`, a run
    of several on one trainer) is the base model in `base_dir` with the adapter merged."""
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from prime_hpc.trainer.lora import PEFT_PREFIX, merge_lora

    if (policy_dir / "model.safetensors").exists() or base_dir is None:
        return AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    conf = json.loads((policy_dir / "adapter" / "adapter_config.json").read_text())
    adapter = load_file(str(policy_dir / "adapter" / "adapter_model.safetensors"))
    sd = {**model.state_dict(), **{k[len(PEFT_PREFIX) :]: v for k, v in adapter.items()}}
    model.load_state_dict(merge_lora(sd, conf["lora_alpha"] / conf["r"]))
    return model


def sample_rollouts(
    policy_dir: Path,
    texts: list[str],
    group_size: int,
    max_new_tokens: int,
    seed: int,
    policy_step: int,
    base_dir: Optional[Path] = None,
) -> list[batch.Sample]:
    """Sample `group_size` completions per prompt from the HF model in `policy_dir`,
    record their log-probabilities, score them (reverse-text LCS ratio) and give each the
    group-centred reward as advantage."""
    import torch
    from reverse_text import build_prompt, lcs_ratio
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir or policy_dir)
    model = load_policy(policy_dir, base_dir)
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for text in texts:
        prompt = list(
            tok.apply_chat_template(build_prompt(text), add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        group = []
        for _ in range(group_size):
            ids = list(prompt)
            with torch.no_grad():
                for _ in range(max_new_tokens):
                    logits = model(torch.tensor([ids])).logits[0, -1]
                    nxt = int(torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen))
                    ids.append(nxt)
                    if nxt == tok.eos_token_id:
                        break
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
                lps = [0.0] + logp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()
            n_prompt = len(prompt)
            completion = tok.decode(ids[n_prompt:], skip_special_tokens=True)
            reward = lcs_ratio(completion.strip(), text[::-1])
            group.append((ids, n_prompt, [lp if i >= n_prompt else 0.0 for i, lp in enumerate(lps)], reward))
        mean = sum(g[3] for g in group) / len(group)
        for ids, n_prompt, lps, reward in group:
            samples.append(
                batch.Sample(
                    input_ids=ids,
                    loss_mask=[i >= n_prompt for i in range(len(ids))],
                    inference_logprobs=lps,
                    advantage=reward - mean,
                    policy_step=policy_step,
                    reward=reward,
                )
            )
    return samples


SAMPLING = threading.Lock()  # one stand-in samples at a time (transformers' loading is not thread-safe)


class StandInOrchestrator(threading.Thread):
    """Writes `rollouts/step_n` for n = 1..steps, each sampled from the newest policy the
    async level allows (policy n - 1, i.e. fully on-policy when async_level >= 1; the
    base model for step 1), exactly as the orchestrator hands them to the trainer."""

    def __init__(
        self,
        run: RunDir,
        base_dir: Path,
        steps: int,
        ranks: int,
        micro_batch_size: int,
        texts: list[str],
        group_size: int = 2,
        max_new_tokens: int = 10,
        timeout_s: float = 600,
        start: int = 1,
        nan_advantages: bool = False,
    ) -> None:
        super().__init__(daemon=True)
        self.start_step = start
        self.nan_advantages = nan_advantages  # a batch no loss can be finite on (a diverged run's)
        self.rundir, self.base_dir, self.steps, self.ranks = run, base_dir, steps, ranks
        self.mbs, self.texts, self.group_size, self.max_new_tokens = micro_batch_size, texts, group_size, max_new_tokens
        self.timeout_s = timeout_s
        self.error: Optional[BaseException] = None
        self.written: list[int] = []

    def run(self) -> None:  # noqa: D102 (thread body)
        try:
            for n in range(self.start_step, self.steps + 1):
                policy = (
                    self.base_dir
                    if n == 1
                    else wait_stable(self.rundir.weights_step(n - 1), timeout_s=self.timeout_s, producer="trainer")
                )
                with SAMPLING:
                    samples = sample_rollouts(
                        policy,
                        self.texts,
                        self.group_size,
                        self.max_new_tokens,
                        seed=n,
                        policy_step=n - 1,
                        base_dir=self.base_dir,
                    )
                if self.nan_advantages:
                    samples = [dataclasses.replace(s, advantage=math.nan) for s in samples]
                batch.write_step(self.rundir, n, batch.shard(samples, self.ranks, self.mbs), info={"temperature": 1.0})
                self.written.append(n)
        except BaseException as e:  # reported by the test
            self.error = e
