"""Typed schema of a run. Hydra composes `conf/` onto these dataclasses, so an unknown
key or a wrongly-typed value fails at composition, before anything is written.

Each component receives only its own sub-tree (plus the few run-level values it needs,
projected by `prime_hpc.config.component`). Units live in field names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from prime_hpc.core.device import DEVICES
from prime_hpc.core.jobenv import CACHE_VAR
from prime_hpc.sched import BACKENDS

MISSING = "???"


@dataclass(frozen=True)
class Rule:
    """The values a field allows, next to its type; checked at submit time by
    `prime_hpc.config.validate.check_fields` (None passes where the type is Optional)."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    choices: Optional[tuple] = None
    pattern: Optional[str] = None
    """a regular expression the whole value must match"""
    example: Optional[str] = None
    """shown with a pattern's error"""

    def violation(self, value: Any) -> Optional[str]:
        if self.pattern is not None:
            import re

            return None if re.fullmatch(self.pattern, str(value)) else f"{value!r} is not valid; e.g. {self.example}"
        if self.choices is not None:
            return None if value in self.choices else f"unknown value {value!r}; choose from {', '.join(self.choices)}"
        lo = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else None
        hi = f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else None
        ok = (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )
        if ok:
            return None
        if lo and hi:
            return f"must be in {lo}, {hi} (got {value})"
        if lo:
            return f"must be {'>=' if self.ge is not None else '>'} {lo[1:]} (got {value})"
        return f"must be {'<=' if self.le is not None else '<'} {(hi or '')[:-1]} (got {value})"


def ruled(default: Any, **rule: Any) -> Any:
    """A dataclass field with a default and its `Rule`, e.g. `lr: float = ruled(1e-6, gt=0)`."""
    return field(default=default, metadata={"rule": Rule(**rule)})


def one_of(default: str, *choices: str) -> Any:
    return ruled(default, choices=choices)


# The vocabularies: each is defined here (devices in `prime_hpc.core.device`, backends in
# `prime_hpc.sched`, one class each), and the code
# that dispatches on one imports it from here.
LEVELS = ("debug", "info", "warning", "error")
LOSS_TYPES = ("dppo", "cispo", "gspo")
TRAINER_TYPES = ("rl", "sft")
TRAINING_MODES = ("rl", "opd", "sft")
TRAJECTORY_STRATEGIES = ("interleaved", "branching")
ADVANTAGES = ("mean", "std", "loo", "opo")
WEIGHT_UPDATES = ("in_flight", "drain")
WEIGHT_TRANSPORTS = ("filesystem", "broadcast")
BENCH_MODES = ("all", "trainer", "inference")


# ----------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    name: str = MISSING
    """HF id or local path; "tiny" = the offline tiny Qwen3 (built on demand)"""
    seed: int = 0
    """only for built models (model=tiny): the builder's seed"""
    trust_remote_code: bool = False


# ----------------------------------------------------------------------------- trainer
@dataclass
class ActivationCheckpointConfig:
    freq: Optional[int] = ruled(None, ge=1)
    """checkpoint every `freq`-th layer; None = off, 1 = every layer"""


@dataclass
class LoRAConfig:
    enabled: bool = False
    rank: int = ruled(16, ge=1)
    alpha: float = ruled(32.0, gt=0)
    dropout: float = ruled(0.0, ge=0, lt=1)
    target_modules: List[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class TrainerModelConfig:
    name: str = "${model.name}"
    """must agree with model.name"""
    ac: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    optimization_dtype: str = one_of("auto", "auto", "bfloat16", "float32")
    """forward/backward; auto = bfloat16 on cuda, float32 on cpu (master weights and optimizer
    state stay float32)"""
    reduce_dtype: str = one_of("float32", "bfloat16", "float32")
    """gradient reduction"""
    grad_sync: str = one_of("last", "last", "every")
    """several ranks: reduce-scatter the gradients after the step's last micro-batch (each
    rank accumulates the whole gradient until then: less traffic) or after every one (each
    rank holds only its shard of it: less memory)"""
    chunked_logprobs: str = ruled("auto", pattern="(?i)auto|true|false", example="auto, true or false")
    """the output layer's log-probabilities at the trained positions (Qwen, Llama, Mistral)
    a chunk at a time, each chunk recomputed in backward: auto = only when one pass would not
    fit in half the device's free memory; true = always; false = never"""
    compile: str = ruled("auto", pattern="(?i)auto|true|false", example="auto, true or false")
    """torch.compile every decoder layer and the loss; auto = where it measured faster (cuda)"""


@dataclass
class TokenizerConfig:
    name: str = "${model.name}"
    """must agree with model.name"""


@dataclass
class OptimConfig:
    lr: float = ruled(1e-6, gt=0)
    weight_decay: float = ruled(0.0, ge=0)
    max_norm: float = ruled(1.0, gt=0)
    """gradient clipping norm"""
    betas: Tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2); a Tuple field takes exactly its length"""
    warmup_steps: int = ruled(0, ge=0)
    schedule: str = one_of("constant", "constant", "linear", "cosine")
    """after warm-up (decay to min_lr_ratio * lr at max_steps)"""
    min_lr_ratio: float = ruled(0.0, ge=0, le=1)
    """linear/cosine: the last step's lr as a fraction of lr"""


@dataclass
class LossConfig:
    type: str = one_of("dppo", *LOSS_TYPES)
    """dppo (mask tokens whose probability moved too far) | cispo (clipped token ratio) | gspo
    (one ratio per sequence: the geometric mean of its token ratios)"""
    mask_low: float = ruled(0.2, ge=0)
    """dppo: mask a token when p_trainer - p_inference < -mask_low (prob. space)"""
    mask_high: float = ruled(0.2, ge=0)
    """dppo: mask a token when p_trainer - p_inference > mask_high"""
    clip_low: float = ruled(0.2, ge=0, lt=1)
    """cispo: lower clip of the importance ratio (1 - clip_low)"""
    clip_high: float = ruled(0.28, ge=0)
    """cispo: upper clip of the importance ratio (1 + clip_high)"""
    seq_clip_low: float = ruled(3e-4, ge=0, lt=1)
    """gspo: mask a sequence with A < 0 whose ratio is below 1 - this"""
    seq_clip_high: float = ruled(4e-4, ge=0)
    """gspo: mask a sequence with A > 0 whose ratio is above 1 + this"""
    ref_kl_coef: float = ruled(0.0, ge=0)
    """> 0: add this x KL(policy || the frozen initial policy), k3 per token"""
    target_kl: Optional[float] = ruled(None, gt=0)
    """adapt ref_kl_coef (its starting value) after every step toward keeping ref_kl/mean
    near this; null = ref_kl_coef fixed"""
    kl_horizon: int = ruled(10, ge=1)
    """target_kl: the controller's horizon in steps; one step moves the coefficient by at
    most 20% / kl_horizon"""
    kl_coef: float = ruled(0.0, ge=0)
    """weight of the optional KL(inference || trainer) term (k3 estimator)"""


@dataclass
class LossMaskConfig:
    system: bool = False
    user: bool = False
    assistant: bool = True
    tool: bool = False


@dataclass
class SFTDataConfig:
    name: Optional[str] = None
    """sft: HF dataset name, local dir/file, or module:function returning a Dataset"""
    split: str = "train"
    seq_len: int = "${seq_len}"  # type: ignore[assignment]
    """packed sample length, tokens"""
    batch_size: int = ruled(8192, ge=1)
    """tokens per trainer step (packed rows of seq_len)"""
    args: Dict[str, Any] = field(default_factory=dict)
    """kwargs of a module:function dataset (or load_dataset)"""
    subsets: Optional[List[str]] = None
    """sft: hub dataset configs (subsets) mixed in training, each read from `split` (or its entry of `splits`)"""
    splits: Optional[List[str]] = None
    """sft: splits mixed in training (one per entry of `subsets`, or alone: splits of `name`)"""
    probabilities: Optional[List[float]] = None
    """sft: sampling weight of each subset/split (normalized); null: in proportion to their sizes"""


@dataclass
class ValConfig:
    interval: Optional[int] = ruled(None, ge=1)
    """sft: validation loss every N steps (and before the first); None = off"""
    stop_below: Optional[float] = None
    """sft: end the run (final weights, checkpoint) once val/loss is below"""
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    """like trainer.data; data.name is required with interval"""


@dataclass
class LogConfig:
    level: str = one_of("info", *LEVELS)
    vf_level: str = one_of("info", *LEVELS)
    """verifiers / env-worker log level (orchestrator only)"""


@dataclass
class TrainerConfig:
    type: str = one_of("rl", *TRAINER_TYPES)
    model: TrainerModelConfig = field(default_factory=TrainerModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    micro_batch_size: int = ruled(1, ge=1)
    """packed rows of seq_len per forward pass (the token budget when micro_batch_tokens is null)"""
    micro_batch_tokens: Optional[int] = ruled(None, ge=1)
    """tokens per forward pass (packed rows x the longest row); null = micro_batch_size x seq_len"""
    max_concurrent_runs: int = ruled(1, ge=1)
    """rl with LoRA: one trainer trains up to this many runs of the job at once (runs/<name>/),
    each its own adapter, optimizer, schedule, steps and checkpoints; 1 = the run alone"""
    rollout_timeout_s: float = ruled(86400.0, gt=0)
    """rl: fail when a step's rollouts have not arrived after this long"""
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    loss_mask: LossMaskConfig = field(default_factory=LossMaskConfig)
    val: ValConfig = field(default_factory=ValConfig)
    log: LogConfig = field(default_factory=lambda: LogConfig(level="${log.level}"))


# ----------------------------------------------------------------------------- orchestrator
@dataclass
class EnvEntry:
    id: str = MISSING
    """a classic env (a module with load_environment(**args)) or a verifiers v1 taskset (a module whose __all__
    exports one Taskset): a path, an installed module or distribution, or owner/name"""
    args: Dict[str, Any] = field(default_factory=dict)
    ratio: float = ruled(1.0, gt=0)
    """relative sampling weight among the listed envs"""
    name: Optional[str] = None
    """metric/log name; defaults to the id"""
    workers: int = ruled(0, ge=0)
    """worker processes of the env's own server (`prime_hpc.envserver`); 0 = in the orchestrator's process
    (a v1 taskset, or an env with `python`, always runs in a server: at least 1)"""
    python: Optional[str] = None
    """the Python interpreter of its server's workers (a venv with the env and its verifiers); None: the run's
    own for a classic env, for a verifiers v1 taskset $PRIME_HPC_ENVS_PYTHON or the .venv-envs tools/setup builds"""
    renderer: Optional[Dict[str, Any]] = None
    """a verifiers v1 taskset's renderer (client-side rendering and parsing of the model's turns: the `renderers`
    config verifiers' train client takes, e.g. {name: qwen3} or {name: default, tool_parser: qwen3}; a tool_parser
    `module:Class` is a parser class of your own); None: resolved from the model, which for a model renderers does
    not know is its chat template without tool calls"""


@dataclass
class SamplingConfig:
    max_tokens: Optional[int] = ruled(None, ge=1)
    """per model turn; None = up to max_model_len"""
    temperature: float = ruled(1.0, ge=0)
    """0 = greedy"""
    top_p: float = ruled(1.0, gt=0, le=1)
    top_k: Optional[int] = ruled(None, ge=1)
    """sample among the k most likely tokens; None = all"""
    min_p: float = ruled(0.0, ge=0, le=1)
    """drop tokens below min_p x the most likely one's probability"""
    repetition_penalty: float = ruled(1.0, gt=0)
    """> 1 discourages repeating tokens (1 = off)"""
    stop: List[str] = field(default_factory=list)
    """end a turn at any of these strings"""
    seed: Optional[int] = None
    """per request: the same prompt then samples the same completions"""
    extra_body: Dict[str, Any] = field(default_factory=dict)
    """more vLLM sampling parameters, verbatim"""


@dataclass
class EvalConfig:
    interval: int = ruled(100, ge=0)
    """eval every N steps (0 = no eval at all, at_start included)"""
    at_start: bool = False
    """also eval the base policy before the first step (logged as step 0)"""
    env: List[EnvEntry] = field(default_factory=list)
    num_examples: Optional[int] = ruled(None, ge=1)
    """None = the whole eval set"""
    rollouts_per_example: int = ruled(1, ge=1)


@dataclass
class ClientConfig:
    base_url: Optional[str] = None
    """OpenAI-compatible endpoint, e.g. http://host:8000/v1"""
    api_key_var: str = "TEACHER_API_KEY"
    """env var holding its key (never the key itself; never the job's own)"""
    model: Optional[str] = None


# orchestrator.teacher.<key>: the engine of the run's own teacher, each replacing inference.<key>
TEACHER_ENGINE = ("tensor_parallel_size", "data_parallel_size", "gpu_memory_utilization", "dtype", "extra_args")


@dataclass
class TeacherConfig:
    """The teacher of `training_mode` opd and sft, one of three: a server anyone runs
    (`client.base_url`), a `prime-hpc serve` job (`serve`), or servers the run starts
    itself (`model`: a group of the run's job, `cluster.teacher`)."""

    client: ClientConfig = field(default_factory=ClientConfig)
    model: Optional[str] = None
    """the run starts its own teacher: servers of this model (a name or a path, like
    model.name) on `cluster.teacher`'s nodes, behind a router of their own"""
    serve: Optional[str] = None
    """a `prime-hpc serve` job (its id or output directory): its URL, its key from the
    variable it names"""
    tensor_parallel_size: Optional[int] = ruled(None, ge=1)
    """the run's own teacher (`model`): vLLM's per replica; None = inference.tensor_parallel_size"""
    data_parallel_size: Optional[int] = ruled(None, ge=1)
    """the run's own teacher: replicas per node; None = cluster.teacher.gpus_per_node / its tensor_parallel_size"""
    gpu_memory_utilization: Optional[float] = ruled(None, gt=0, le=1)
    """the run's own teacher: None = inference.gpu_memory_utilization"""
    dtype: Optional[str] = ruled(None, choices=("auto", "float16", "bfloat16", "float32"))
    """the run's own teacher: vLLM --dtype; None = inference.dtype"""
    extra_args: Optional[List[str]] = None
    """the run's own teacher: passed verbatim to its vLLM servers; None = inference.extra_args"""


@dataclass
class DifficultyFilterConfig:
    min_reward: Optional[float] = None
    """drop a group whose mean reward is below this (too hard); None = keep"""
    max_reward: Optional[float] = None
    """drop a group whose mean reward is above this (too easy); None = keep"""
    min_reward_variance: float = ruled(0.0, ge=0)
    """drop a group whose rewards vary less (population variance)"""


@dataclass
class OrchestratorModelConfig:
    name: str = "${model.name}"
    """must agree with model.name"""


@dataclass
class OrchestratorConfig:
    model: OrchestratorModelConfig = field(default_factory=OrchestratorModelConfig)
    batch_size: int = ruled(128, ge=1)
    """rollouts per trainer step"""
    group_size: int = ruled(8, ge=1)
    """rollouts per example (batch_size must be a multiple)"""
    max_off_policy_steps: int = ruled(8, ge=1)
    """drop a rollout touched by more distinct policies than this"""
    max_concurrent: int = ruled(256, ge=1)
    """in-flight generation requests"""
    generation_timeout_s: float = ruled(3600.0, gt=0)
    """how long one generation request may take before it fails (the policy client's timeout)"""
    max_prompt_len: Optional[int] = ruled(None, ge=1)
    """drop a train task whose prompt is longer (tokens, the model's chat template applied)
    before it is sent; counted per step as `filter/long_prompts`. None = no limit"""
    max_errored_groups: int = ruled(100, ge=0)
    """End the run (the orchestrator exits non-zero, quoting the env's error and naming its
    log) after this many errored train groups in a row: every rollout of the group raised,
    its reward raised or it produced no completion. 0 = never (the watchdog still ends a
    run that writes no step for `watchdog.stall_timeout_s`)."""
    training_mode: str = one_of("rl", *TRAINING_MODES)
    online_difficulty_filtering: bool = False
    """drop groups whose rewards have no variance"""
    difficulty_filter: DifficultyFilterConfig = field(default_factory=DifficultyFilterConfig)
    oversampling_factor: float = ruled(1.0, ge=1)
    """admit this many times the groups the steps need, so a step stays full when filters drop
    groups (generation beyond that is wasted: it turns stale)"""
    trajectory_strategy: str = one_of("interleaved", *TRAJECTORY_STRATEGIES)
    """interleaved: a multi-turn rollout is one sample (each turn's prompt must extend the
    tokens so far) | branching: a new sample where it does not (chat templates that drop
    earlier reasoning, e.g. Qwen3's)"""
    advantage: str = one_of("mean", *ADVANTAGES)
    """mean: r - group mean | std: ... / group std | loo: r - mean of the others | opo: r -
    the group's length-weighted mean (each reward weighted by its completion tokens)"""
    env: List[EnvEntry] = field(default_factory=list)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """opd/sft need client.base_url; rl forbids it"""
    log: LogConfig = field(default_factory=lambda: LogConfig(level="${log.level}"))


# ----------------------------------------------------------------------------- inference
@dataclass
class InferenceModelConfig:
    name: str = "${model.name}"
    """must agree with model.name"""
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None


@dataclass
class InferenceConfig:
    model: InferenceModelConfig = field(default_factory=InferenceModelConfig)
    dtype: str = one_of("auto", "auto", "float16", "bfloat16", "float32")
    """vLLM --dtype"""
    max_model_len: Optional[int] = "${seq_len}"  # type: ignore[assignment]
    """context length; must be <= seq_len"""
    gpu_memory_utilization: float = ruled(0.9, gt=0, le=1)
    tensor_parallel_size: int = ruled(1, ge=1)
    data_parallel_size: Optional[int] = ruled(None, ge=1)
    """per node; None = gpus_per_node / tensor_parallel_size"""
    cpu_kvcache_space_gb: int = ruled(1, ge=1)
    """CPU only: VLLM_CPU_KVCACHE_SPACE"""
    cpu_threads: Optional[int] = ruled(None, ge=1)
    """CPU only: OMP threads; None = what SLURM gave the task"""
    extra_args: List[str] = field(default_factory=list)
    """passed verbatim to the vLLM server"""
    startup_timeout_s: int = ruled(600, ge=1)
    max_restarts: int = ruled(3, ge=0)
    """a server that dies (or hangs) is restarted in its slot at most this often per attempt"""
    stall_timeout_s: float = ruled(600, ge=0)
    """a server with requests in flight that finishes none for this long, or that is this
    long in one weight update, is hung: taken out, killed and restarted (the watchdog's
    check; 0 = off); set above the longest generation and the longest weight update"""
    weight_update: str = one_of("in_flight", *WEIGHT_UPDATES)
    """in_flight: an update pauses generation keeping the requests in flight and their KV
    cache, loads the weights and resumes (a completion may span policies); drain: it waits
    until no generation is in flight (at most 600 s), every completion is one policy's"""


# ----------------------------------------------------------------------------- bench


@dataclass
class BenchConfig:
    """A bench run (`prime-hpc submit ... --bench`): the run's own config and placement, on
    synthetic data, for a fixed number of steps; results in `<output_dir>/bench.json`."""

    mode: Optional[str] = ruled(None, choices=BENCH_MODES)
    """null = a training run | all | trainer (fake batches of the configured shape) | inference
    (fixed prompts through the servers, no env)"""
    steps: int = ruled(5, ge=1)
    """measured steps"""
    warmup_steps: int = ruled(1, ge=0)
    """steps run first and not counted (compilation, caches)"""
    samples_per_step: Optional[int] = ruled(None, ge=1)
    """rl: rollouts per step; null = orchestrator.batch_size"""
    group_size: Optional[int] = ruled(None, ge=1)
    """completions per prompt; null = orchestrator.group_size"""
    completion_len: Optional[int] = ruled(None, ge=1)
    """inference: tokens of every completion (EOS ignored); trainer: the longest, each sample's
    drawn uniformly from 1 to this; null = orchestrator.sampling.max_tokens, or half of seq_len
    when that is null too"""


@dataclass
class EvalJobConfig:
    """An eval job (`prime-hpc eval` on a cluster; set by the command, not by hand): the
    job's inference servers, and on the head the eval runner, which scores each step on
    `orchestrator.eval.env` and writes `<results>/step_<n>.json` and
    `step_<n>.samples.jsonl`."""

    steps: List[int] = field(default_factory=list)
    """the policy steps to score, in order; 0 = the base model; empty = not an eval job"""
    run: Optional[str] = None
    """the run whose `weights/step_<n>` are scored (null: the model as it is, step 0 only)"""
    results: Optional[str] = None
    """where the results go (null: the job's output_dir)"""


@dataclass
class ServeConfig:
    """A serve job (`prime-hpc serve`; set by the command): the inference servers behind the
    router, and on the head a process that publishes their URL in `<output_dir>/serve.json`
    and keeps the job up until it is cancelled or reaches its time limit."""

    enabled: bool = False


@dataclass
class SynthesizeConfig:
    """A synthesize job (`prime-hpc synthesize`; set by the command): the model's inference
    servers, and on the head a runner that plays `orchestrator.env` against them and writes
    the rollouts that pass as an SFT dataset (`<out>/data.jsonl`, the `messages` layout)."""

    out: Optional[str] = None
    """the directory data.jsonl and summary.json go to; null = not a synthesize job"""
    rollouts: int = ruled(1, ge=1)
    """rollouts per example"""
    examples: Optional[int] = ruled(None, ge=1)
    """examples of each env's training set, from its start; null = all of them"""
    min_reward: Optional[float] = None
    """keep only rollouts with at least this reward; null = every rollout that did not fail"""


# ----------------------------------------------------------------------------- run-level
@dataclass
class WeightsCkptConfig:
    save_adapter_separately: bool = False
    """LoRA: the servers load the adapter (always written next to the merged weights) instead
    of the merged weights"""
    interval: Optional[int] = ruled(None, ge=1)
    """keep weights/step_N (HF format, no optimizer: not a resume point) every N steps"""
    keep_last: Optional[int] = ruled(None, ge=1)
    """keep only the newest N weights-only snapshots (null = all; checkpointed steps' weights always stay)"""


@dataclass
class WeightsConfig:
    transport: str = one_of("filesystem", *WEIGHT_TRANSPORTS)
    """how a new policy reaches the inference servers. filesystem: the trainer writes
    weights/step_N and each server loads it; broadcast: the trainer sends it straight to
    each server's workers over a process group of their own (NCCL on GPUs, gloo on CPU),
    and weights/step_N holds the full weights only at checkpoints and the last step (a
    marker otherwise); the servers still load from disk what is on disk (a resume)"""


@dataclass
class CkptConfig:
    enabled: bool = False
    """save a checkpoint at the end of training (off by default: disk)"""
    interval: Optional[int] = ruled(None, ge=1)
    """...and every N steps (implies enabled)"""
    keep_last: Optional[int] = ruled(None, ge=1)
    """keep only the newest N checkpoints"""
    keep_interval: Optional[int] = ruled(None, ge=1)
    """...plus every checkpoint whose step is a multiple of N"""
    step: Optional[int] = ruled(None, ge=-1)
    """resume from this step (-1 = latest complete checkpoint)"""
    save_async: bool = False
    weights_only: bool = False
    """at the steps above keep only the HF weights (weights/step_N), no full checkpoint:
    cheaper, but not a resume point"""
    weights: WeightsCkptConfig = field(default_factory=WeightsCkptConfig)


@dataclass
class TrainerExtrasConfig:
    interval: Optional[int] = ruled(None, ge=0)
    """every N trainer steps (0 = never); null = wandb.log_extras.interval"""
    distributions: bool = True
    """histograms of the trained tokens' entropy and (RL) advantages"""


@dataclass
class LogExtrasConfig:
    interval: int = ruled(10, ge=0)
    """every N steps (0 = never): the extras below, in the W&B run"""
    samples: bool = True
    """a table of sampled rollouts: prompt, completion, reward, advantage"""
    distributions: bool = True
    """histograms of the step's rewards and advantages"""
    sample_ratio: float = ruled(0.1, gt=0, le=1)
    """share of the step's rollouts in the table (at least one)"""
    trainer: TrainerExtrasConfig = field(default_factory=TrainerExtrasConfig)
    """the trainer's own extras"""


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "prime-hpc"
    name: Optional[str] = None
    """defaults to the run name"""
    entity: Optional[str] = None
    offline: bool = False
    """write the run locally (<output_dir>/wandb/); `wandb sync` uploads it later"""
    log_extras: LogExtrasConfig = field(default_factory=LogExtrasConfig)


@dataclass
class GroupResources:
    nodes: int = ruled(1, ge=1)
    gpus_per_node: int = ruled(0, ge=0)
    cpus_per_task: int = ruled(1, ge=1)
    mem_gb: Optional[float] = ruled(None, gt=0)
    """None = the partition default"""
    nproc_per_node: Optional[int] = ruled(None, ge=1)
    """trainer only: ranks per node (default gpus_per_node or 1)"""
    cpu_ids: Optional[str] = None
    """cores the group's tasks are pinned to, e.g. "0-3"; None = what the allocation binds
    (SLURM); "auto" = this group's share of this machine (one host: local, dev)"""
    gpu_ids: Optional[str] = None
    """cuda: the GPUs of a node this group's processes see (CUDA_VISIBLE_DEVICES), e.g. "0-3";
    as many as gpus_per_node. None = what the allocation gives (SLURM); locally, inference
    takes the first GPUs of the machine and the trainer the next"""


@dataclass
class ClusterConfig:
    backend: str = one_of("local", *BACKENDS)
    device: str = one_of("cpu", *DEVICES)
    """the one switch for accelerators (NCCL vs gloo, vllm vs vllm-cpu)"""
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time: str = "04:00:00"
    """wall-clock limit, SLURM format"""
    constraint: Optional[str] = None
    exclude: Optional[str] = None
    sbatch_extra: List[str] = field(default_factory=list)
    """extra lines, each becomes `#SBATCH <line>`"""
    env_setup: List[str] = field(default_factory=list)
    """shell lines run before any component"""
    python: Optional[str] = None
    """interpreter on the nodes; None = the submitting one"""
    cache_dir: Optional[str] = f"${{oc.env:{CACHE_VAR},null}}"
    """shared caches (built models, the inference compile cache) on a filesystem every node
    sees; null = <output_dir>/../.prime-hpc-cache"""
    share_gpus: bool = False
    """allow inference and trainer gpu_ids to overlap on one node"""
    address: Optional[str] = None
    """what servers bind to and publish; None = each node's own address (real clusters);
    127.0.0.1 when every node is this machine (local, dev): all traffic on loopback"""
    signal_delay_s: int = ruled(120, ge=0)
    """warning this long before the time limit: checkpoint, then requeue"""
    max_requeues: int = ruled(10, ge=0)
    """requeues (time limits, preemptions, scontrol requeue) before the run stops"""
    inference_job: str = one_of("het", "het", "own")
    """het: the inference servers are a group of the run's het job (started together; a lost
    node of the job costs an attempt); own: one plain job per server, submitted with the
    run's (queued on their own; a lost inference node costs only its server)"""
    umask: str = ruled("027", pattern="0?[0-7]{3}", example="027")
    """what the run writes (run dir, logs, weights) is not readable by other users of the
    cluster; 022 shares it read-only"""
    orchestrator: GroupResources = field(default_factory=GroupResources)
    inference: GroupResources = field(default_factory=GroupResources)
    trainer: GroupResources = field(default_factory=GroupResources)
    teacher: GroupResources = field(default_factory=GroupResources)
    """the teacher's servers (`orchestrator.teacher.model`), one per node"""


@dataclass
class WatchdogConfig:
    stall_timeout_s: float = ruled(600, ge=0)
    """a component alive but silent (no heartbeat, or no progress while not waiting for
    another) this long fails the job, naming it; 0 = no watchdog. A trainer step or an eval
    longer than this counts as a stall: raise it for big models"""


@dataclass
class WarmupConfig:
    experiment: Optional[str] = None
    """an SFT experiment run first, as its own job; this run starts from its final weights
    (SLURM afterok; locally one after the other). null = no warm-up"""
    overrides: List[str] = field(default_factory=list)
    """for the warm-up, e.g. ["max_steps=600"]"""


@dataclass
class RunConfig:
    name: str = "run"
    """run name: job name, W&B name, default output_dir"""
    output_dir: str = "outputs/${name}"
    clean_output_dir: bool = False
    """wipe a non-empty output_dir of a fresh run"""
    job_dir: Optional[str] = None
    """a run of a job that trains several (trainer.max_concurrent_runs): the job's directory,
    whose servers and trainer it shares (output_dir is runs/<name>/ in it); null = a run alone"""
    max_steps: Optional[int] = ruled(None, ge=1)
    """absolute target step; None = until the data runs out"""
    seq_len: int = ruled(2048, ge=1)
    """trainer sequence length, tokens"""
    async_level: int = 2
    """rollouts for step n come from a policy no older than n - async_level"""
    seed: int = 42
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    eval_job: EvalJobConfig = field(default_factory=EvalJobConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    synthesize: SynthesizeConfig = field(default_factory=SynthesizeConfig)
