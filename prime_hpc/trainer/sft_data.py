"""SFT data: load a dataset, tokenize it with role-based loss masks, pack it into rows.

`data.name` may be
- a `module:function` (a callable returning a `datasets.Dataset`, called with `data.args`),
  e.g. `reverse_text:make_sft_dataset`;
- a local directory written by `Dataset.save_to_disk` (a `DatasetDict` is indexed by
  `data.split`), or a local `.json`/`.jsonl`/`.parquet`/`.csv` file;
- a Hugging Face hub name (`datasets.load_dataset(name, split=data.split, **data.args)`).
`data.subsets` / `data.splits` name several parts of it (hub configs, splits), loaded in
turn and mixed (`Mix`, `SFTStream`): by `data.probabilities` when set, else shuffled together.

Columns: `messages` (a list of chat messages), or `prompt` + `completion` (each a list of
messages or a string: a string prompt is one user message, a string completion one
assistant message). When both layouts are present, `messages` wins. Optional per-row
columns: `tools` (OpenAI function-calling entries `{type: function, function: {...}}`) or
`tool_defs` (verifiers' `{name, description, parameters[, strict]}`, turned into the OpenAI
shape), each a list or a JSON string of one, go to the chat template's `tools=` (`tools`
wins when a row has both); `chat_template_kwargs` (a dict or a JSON string of one) is
passed on to `apply_chat_template` (e.g. `{"enable_thinking": false}`). A bad value is one
UserError naming the dataset, the sample and the column.

Loss masks come from incremental chat-template tokenization: the tokens that rendering
message i adds to the rendering of messages[:i] belong to message i's role, and are
trained when `loss_mask.<role>` is true. For an assistant message, the generation prompt
(e.g. `<|im_start|>assistant\\n`) is never trained: the model is only asked to continue
after it. In the prompt/completion layout the prompt is never trained. A template that is
not prefix-stable (rendering fewer messages does not give a prefix of the tokens of more,
e.g. one dropping past `<think>` blocks) makes each trained assistant turn of that
conversation a sample of its own, rendered after its own prefix; with another role
trained as well, the dataset is rejected with the index of the offending sample.

Packing: samples (truncated to `seq_len`) are placed in order into rows of at most
`seq_len` tokens; positions restart at 0 for every sample, so the model's packed-sequence
masking keeps samples from attending to each other, and the first token of every sample
is never trained (it would be predicted from the previous sample). One step takes
`rows_per_step` rows; the order is a fresh permutation of the dataset per epoch.
"""

from __future__ import annotations

import importlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from prime_hpc.core.errors import UserError

ROLES = ("system", "user", "assistant", "tool")
_CALLABLE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


# ----------------------------------------------------------------------------- loading
def load_dataset(name: str, split: str = "train", args: Optional[dict] = None, subset: Optional[str] = None) -> Any:
    """The dataset `name` (see the module docstring), its config `subset` when given (hub
    datasets only); one-line UserError when it cannot be loaded."""
    import datasets

    datasets.disable_progress_bars()  # bars would garble the per-rank logs and the one-line errors
    args = dict(args or {})
    path = Path(name).expanduser()
    if subset is not None and (path.exists() or _CALLABLE.match(name)):
        raise UserError(
            f"dataset {name!r}: trainer.data.subsets name configs of a hub dataset; a local path or "
            "module:function has none (use trainer.data.splits, or one dataset per run)"
        )
    try:
        if subset is not None:
            return datasets.load_dataset(name, subset, split=split, **args)
        if _CALLABLE.match(name) and not path.exists():
            return _from_callable(name, args)
        if path.is_dir():
            return _from_disk(name, path, split)
        if path.is_file():
            builder = _FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise UserError(
                    f"dataset {name!r}: unsupported file type {path.suffix!r}; use "
                    f"{', '.join(sorted(_FILE_BUILDERS))} or a save_to_disk directory"
                )
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        return datasets.load_dataset(name, split=split, **args)
    except UserError:
        raise
    except Exception as e:  # datasets raises many types for "cannot load"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        what = f"subset {subset!r}, split {split!r}" if subset is not None else f"split {split!r}"
        raise UserError(f"dataset {name!r} ({what}) cannot be loaded: {first}") from None


def sources(cfg: Any) -> list[tuple[str, Optional[str], str]]:
    """(label, subset, split) of every part of `trainer.data` (`cfg`): one per entry of
    `subsets` / `splits`, or the dataset itself (label "") when neither is set."""
    subsets, splits = list(cfg.subsets or []), list(cfg.splits or [])
    if subsets and splits:
        return [(f"{a}/{b}", a, b) for a, b in zip(subsets, splits)]
    if subsets:
        return [(a, a, cfg.split) for a in subsets]
    return [(b, None, b) for b in splits] or [("", None, cfg.split)]


def _from_callable(name: str, args: dict) -> Any:
    module, _, fn = name.partition(":")
    try:
        func = getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as e:
        raise UserError(f"dataset {name!r}: cannot import {fn} from {module} ({e})") from None
    ds = func(**args)
    if not hasattr(ds, "column_names"):
        raise UserError(f"dataset {name!r}: {name}(...) returned {type(ds).__name__}, not a datasets.Dataset")
    return ds


def _from_disk(name: str, path: Path, split: str) -> Any:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(f"dataset {name!r} has no split {split!r}; splits: {', '.join(ds.keys())}")
        ds = ds[split]
    return ds


def layout(ds: Any, name: str) -> str:
    """'messages' or 'prompt_completion'; one-line UserError naming the columns found."""
    cols = list(ds.column_names)
    if len(ds) == 0:
        raise UserError(f"dataset {name!r} is empty (columns found: {', '.join(cols) or 'none'})")
    if "messages" in cols:
        return "messages"
    if "prompt" in cols and "completion" in cols:
        return "prompt_completion"
    raise UserError(
        f"dataset {name!r} needs a 'messages' column or 'prompt' and 'completion' columns; "
        f"columns found: {', '.join(cols) or 'none'}"
    )


# ----------------------------------------------------------------------------- tokenizing
def _as_messages(value: Any, default_role: str, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        return [dict(m) for m in value]
    raise UserError(f"{where}: expected a string or a list of {{role, content}} messages, got {type(value).__name__}")


# keys the masking sets itself; a row's chat_template_kwargs may not override them
_RESERVED_KWARGS = ("conversation", "messages", "tools", "tokenize", "return_dict", "add_generation_prompt")


def _json_column(row: dict, column: str, kind: type, where: str) -> Any:
    """Row `column` as a `kind` (list or dict): the value itself or a JSON string of one;
    None when the column is absent, null or empty."""
    value = row.get(column)
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UserError(f"{where} column {column!r}: not valid JSON ({e})") from None
    if value is None:
        return None
    if not isinstance(value, kind):
        raise UserError(
            f"{where} column {column!r}: expected a {kind.__name__} or a JSON string of one, got {type(value).__name__}"
        )
    return value or None


def row_tools(row: dict, where: str) -> Optional[list[dict]]:
    """The row's tools in the OpenAI function-calling shape: its `tools` column, else its
    `tool_defs` (verifiers' `{name, description, parameters, strict}`) converted."""
    tools = _json_column(row, "tools", list, where)
    if tools is not None:
        for j, t in enumerate(tools):
            if not isinstance(t, dict):
                raise UserError(f"{where} column 'tools' entry {j}: expected a dict, got {type(t).__name__}")
        return tools
    defs = _json_column(row, "tool_defs", list, where)
    return None if defs is None else [openai_tool(d, j, where) for j, d in enumerate(defs)]


def openai_tool(d: Any, j: int, where: str) -> dict:
    """One tool definition in the OpenAI function-calling shape a chat template reads: verifiers'
    {name, description, parameters, strict}, or one already in that shape."""
    if isinstance(d, dict) and d.get("type") == "function" and isinstance(d.get("function"), dict):
        return d  # already in the OpenAI shape
    if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not d["name"]:
        raise UserError(
            f"{where} column 'tool_defs' entry {j}: expected {{name, description, parameters}} with a string name, "
            f"got {json.dumps(d, default=str)[:120]}"
        )
    fn = {k: d[k] for k in ("name", "description", "parameters", "strict") if d.get(k) is not None}
    return {"type": "function", "function": fn}


def row_template_kwargs(row: dict, where: str) -> dict:
    """The row's `chat_template_kwargs` (empty when absent)."""
    kwargs = _json_column(row, "chat_template_kwargs", dict, where) or {}
    bad = [k for k in kwargs if not isinstance(k, str) or k in _RESERVED_KWARGS]
    if bad:
        raise UserError(
            f"{where} column 'chat_template_kwargs': {bad[0]!r} cannot be set per row "
            f"(the loss masking sets {', '.join(_RESERVED_KWARGS[2:])})"
        )
    return kwargs


def _render(
    tokenizer: Any, messages: list[dict], tools: Any, generation_prompt: bool = False, kwargs: Optional[dict] = None
) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=True,
        return_dict=False,
        add_generation_prompt=generation_prompt,
        **(kwargs or {}),
    )
    if isinstance(ids, dict):  # a tokenizer that answers with its encoding
        ids = ids["input_ids"]
    return list(ids)


def tokenize_messages(
    tokenizer: Any,
    messages: list[dict],
    trainable: dict[str, bool],
    first_trainable: int = 0,
    tools: Any = None,
    where: str = "sample",
    template_kwargs: Optional[dict] = None,
) -> tuple[list[int], list[bool]]:
    """Token ids of the whole conversation and a per-token loss mask: message i's tokens
    are trained when `trainable[role]` and i >= `first_trainable`. `tools` and
    `template_kwargs` go to every rendering."""
    for i, msg in enumerate(messages):
        if msg.get("role") not in ROLES:
            raise UserError(f"{where}: message {i} has role {msg.get('role')!r}; expected one of {', '.join(ROLES)}")
    ids: list[int] = []
    mask: list[bool] = []
    for i, msg in enumerate(messages):
        role = msg["role"]
        train = trainable[role] and i >= first_trainable
        if role == "assistant" and i > 0:
            head = _render(tokenizer, messages[:i], tools, True, template_kwargs)
            _check_prefix(ids, head, where)
            mask += [False] * (len(head) - len(ids))
            ids = head
        full = _render(tokenizer, messages[: i + 1], tools, False, template_kwargs)
        _check_prefix(ids, full, where)
        mask += [train] * (len(full) - len(ids))
        ids = full
    return ids, mask


class NotPrefixStable(UserError):
    """The chat template rewrote earlier tokens when a message was added."""


def _check_prefix(prefix: list[int], full: list[int], where: str) -> None:
    if full[: len(prefix)] != prefix:
        raise NotPrefixStable(
            f"{where}: the chat template is not prefix-stable (rendering fewer messages is not a prefix "
            "of rendering more), so role-based loss masks cannot be built; use a template that keeps "
            "earlier turns unchanged"
        )


def tokenize_conversation(
    tokenizer: Any,
    messages: list[dict],
    trainable: dict[str, bool],
    first_trainable: int = 0,
    tools: Any = None,
    where: str = "sample",
    template_kwargs: Optional[dict] = None,
) -> tuple[list[tuple[list[int], list[bool]]], bool]:
    """(samples, whether they are per turn). The conversation as one sample (`tokenize_messages`) when the template is prefix-stable.
    Otherwise (a template that rewrites earlier turns, e.g. one dropping past `<think>`
    blocks) one sample per trained assistant turn: the turn rendered after its own prefix
    (messages[:i] with the generation prompt, untrained) as the template renders it at that
    point. Only assistant turns can be trained that way: a template that rewrites earlier
    turns with another role trained (`trainable`) keeps the prefix error."""
    try:
        return [
            tokenize_messages(tokenizer, messages, trainable, first_trainable, tools, where, template_kwargs)
        ], False
    except NotPrefixStable as e:
        other = sorted(
            {m["role"] for m in messages[first_trainable:] if m["role"] != "assistant" and trainable[m["role"]]}
        )
        if other:
            raise NotPrefixStable(
                f"{e}, or train only assistant turns (trainer.loss_mask.{other[0]}=false): each is then its own "
                "sample after its own prefix"
            ) from None
    out = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant" or not trainable["assistant"] or i < first_trainable:
            continue
        head = _render(tokenizer, messages[:i], tools, True, template_kwargs) if i > 0 else []
        full = _render(tokenizer, messages[: i + 1], tools, False, template_kwargs)
        _check_prefix(head, full, f"{where} message {i}")
        out.append((full, [False] * len(head) + [True] * (len(full) - len(head))))
    return out, True


def _row_messages(row: dict, kind: str, where: str) -> tuple[list[dict], int]:
    """The row's conversation and the index of its first trainable message."""
    if kind == "messages":
        return _as_messages(row["messages"], "user", where), 0
    prompt = _as_messages(row["prompt"], "user", where)
    return prompt + _as_messages(row["completion"], "assistant", where), len(prompt)


def tokenize_dataset(
    ds: Any, name: str, tokenizer: Any, loss_mask: Any, seq_len: int
) -> list[tuple[list[int], list[bool]]]:
    """Every sample as (ids, mask), truncated to `seq_len`; samples without any trained
    token are dropped. UserError when nothing is left."""
    kind = layout(ds, name)
    trainable = {r: bool(getattr(loss_mask, r)) for r in ROLES}
    out = []
    per_turn = 0
    for i, row in enumerate(ds):
        where = f"dataset {name!r} sample {i}"
        tools, kwargs = row_tools(row, where), row_template_kwargs(row, where)
        msgs, first = _row_messages(row, kind, where)
        samples, split = tokenize_conversation(tokenizer, msgs, trainable, first, tools, where, kwargs)
        per_turn += split
        for ids, mask in samples:
            ids, mask = ids[:seq_len], mask[:seq_len]
            if mask:
                mask[0] = False  # nothing precedes the first token of a sample
            if any(mask):
                out.append((ids, mask))
    if per_turn:
        from loguru import logger

        logger.info(
            f"dataset {name!r}: the chat template rewrites earlier turns in {per_turn} conversation(s); "
            "each of their assistant turns is a sample of its own, after its own prefix"
        )
    if not out:
        on = [r for r in ROLES if trainable[r]]
        raise UserError(
            f"dataset {name!r}: no sample has a trained token (loss_mask trains roles {on or 'none'}); "
            f"check trainer.loss_mask and the dataset's roles"
        )
    return out


def load_parts(cfg: Any, tokenizer: Any, loss_mask: Any) -> tuple[list[tuple[list[int], list[bool]]], Optional[Mix]]:
    """The samples of `trainer.data` (`cfg`), every part (`sources`) loaded and tokenized
    in turn, and their `Mix` when there are two or more parts."""
    parts = sources(cfg)
    samples: list[tuple[list[int], list[bool]]] = []
    part: list[int] = []
    for k, (label, subset, split) in enumerate(parts):
        ds = load_dataset(cfg.name, split, cfg.args, subset)
        got = tokenize_dataset(ds, f"{cfg.name}[{label}]" if label else cfg.name, tokenizer, loss_mask, cfg.seq_len)
        samples += got
        part += [k] * len(got)
    if len(parts) < 2:
        return samples, None
    weights = [float(w) for w in cfg.probabilities] if cfg.probabilities else None
    return samples, Mix(part, [label for label, _, _ in parts], weights)


# ----------------------------------------------------------------------------- packing
@dataclass
class Row:
    samples: list[tuple[list[int], list[bool]]]

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.samples)


def collate_rows(rows: list[Row], pad_id: int) -> dict:
    """One micro-batch of packed rows: input_ids, position_ids (restarting per sample and
    in the padding), loss_mask, plus num_tokens / num_samples for metrics."""
    import torch

    t = max(1, max((r.num_tokens for r in rows), default=1))
    b = len(rows)
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    pos = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, row in enumerate(rows):
        at = 0
        for s_ids, s_mask in row.samples:
            n = len(s_ids)
            ids[i, at : at + n] = torch.tensor(s_ids)
            pos[i, at : at + n] = torch.arange(n)
            mask[i, at : at + n] = torch.tensor(s_mask)
            at += n
        pos[i, at:] = torch.arange(t - at)
    return {
        "input_ids": ids,
        "position_ids": pos,
        "loss_mask": mask,
        "num_tokens": torch.tensor(sum(r.num_tokens for r in rows)),
        "num_samples": torch.tensor(sum(len(r.samples) for r in rows)),
    }


def pack(samples: Iterable[tuple[list[int], list[bool]]], seq_len: int) -> list[Row]:
    """All of `samples` into rows, in order (a row is closed when the next sample does not fit)."""
    rows: list[Row] = []
    cur = Row([])
    for s in samples:
        if cur.samples and cur.num_tokens + len(s[0]) > seq_len:
            rows.append(cur)
            cur = Row([])
        cur.samples.append(s)
    if cur.samples:
        rows.append(cur)
    return rows


@dataclass
class Mix:
    """The parts of a mixed dataset: each sample's part (`part[i]`), the parts' labels
    (`progress/<label>/ratio_*`) and, when set, their sampling weights."""

    part: list[int]
    labels: list[str]
    weights: Optional[list[float]] = None


class SFTStream:
    """The training stream: per-epoch shuffled samples packed into rows, a step at a time.
    Its position (`state()`) is what a checkpoint stores. With a `Mix` of weights, an
    epoch is as many draws as there are samples: each draw picks a part by weight and takes
    that part's next sample (a part used up starts again, reshuffled); the order is a
    function of the seed and the epoch, so the position alone still resumes it."""

    def __init__(
        self,
        samples: list[tuple[list[int], list[bool]]],
        seq_len: int,
        seed: int,
        epochs: Optional[int] = None,
        mix: Optional[Mix] = None,
    ) -> None:
        self.samples, self.seq_len, self.seed, self.epochs, self.mix = samples, seq_len, seed, epochs, mix
        self.epoch, self.position = 0, 0
        self.taken: list[int] = []  # the samples of the last next_rows
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.samples)))
        rng = random.Random(f"sft/{self.seed}/{epoch}")
        rng.shuffle(order)
        if self.mix is None or self.mix.weights is None:
            return order
        mix, parts = self.mix, range(len(self.mix.labels))
        by_part = [[i for i in order if mix.part[i] == k] for k in parts]
        at = [0] * len(by_part)
        out = []
        for _ in order:
            k = rng.choices(parts, weights=mix.weights)[0]
            if at[k] == len(by_part[k]):
                rng.shuffle(by_part[k])
                at[k] = 0
            out.append(by_part[k][at[k]])
            at[k] += 1
        return out

    def ratios(self) -> dict[str, float]:
        """`progress/<label>/ratio_samples` and `ratio_tokens` of the last `next_rows`: each
        part's share of its samples and of its tokens (empty without a mix of two or more)."""
        if self.mix is None or len(self.mix.labels) < 2 or not self.taken:
            return {}
        tokens = [len(self.samples[i][0]) for i in self.taken]
        out = {}
        for k, label in enumerate(self.mix.labels):
            mine = [j for j, i in enumerate(self.taken) if self.mix.part[i] == k]
            out[f"progress/{label}/ratio_samples"] = len(mine) / len(self.taken)
            out[f"progress/{label}/ratio_tokens"] = sum(tokens[j] for j in mine) / max(1, sum(tokens))
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)

    @property
    def progress_epochs(self) -> float:
        return self.epoch + self.position / len(self.samples)

    def exhausted(self) -> bool:
        return self.epochs is not None and self.epoch >= self.epochs

    def next_rows(self, n: int) -> tuple[list[Row], int]:
        """Up to `n` rows (fewer only when the last epoch ends); returns (rows, samples used).
        A row is closed when the next sample does not fit, so the last row of a step is
        as full as the data allows and no sample is split or skipped."""
        rows: list[Row] = []
        cur = Row([])
        used = 0
        self.taken = []
        while len(rows) < n and not self.exhausted():
            s = self.samples[self._order[self.position]]
            if cur.samples and cur.num_tokens + len(s[0]) > self.seq_len:
                rows.append(cur)
                cur = Row([])
                continue
            cur.samples.append(s)
            self.taken.append(self._order[self.position])
            used += 1
            self.position += 1
            if self.position == len(self.samples):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
                if self.exhausted() and cur.samples:
                    rows.append(cur)
                    cur = Row([])
        return rows, used


def split_rows(rows: list[Row], rank: int, world: int, rows_per_rank: int) -> list[Row]:
    """This rank's rows of a step (round robin), padded with empty rows so every rank gets
    `rows_per_rank` (FSDP needs the same number of forward passes everywhere)."""
    mine = rows[rank::world][:rows_per_rank]
    return mine + [Row([]) for _ in range(rows_per_rank - len(mine))]


def micro_batches(rows: list[Row], micro_batch_size: int, pad_id: int) -> list[dict]:
    return [collate_rows(rows[i : i + micro_batch_size], pad_id) for i in range(0, len(rows), micro_batch_size)]
