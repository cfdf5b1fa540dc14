"""The bundled reverse_text verifiers environment (examples/reverse_text) against a real
vLLM server."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import reverse_text  # noqa: E402
from reverse_text import lcs_ratio  # noqa: E402


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


# --- against a real vLLM server -------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_server(inference):
    """The session's real inference (two servers of the tiny model behind the router)."""
    from prime_hpc.model import resolve_model

    return {
        "url": inference.endpoints.router,
        "model": "tiny",
        "model_dir": Path(resolve_model("tiny")),
        "key": inference.key,
    }


def _client(server):
    from openai import AsyncOpenAI
    from verifiers.clients import OpenAIChatCompletionsClient

    return OpenAIChatCompletionsClient(
        AsyncOpenAI(base_url=server["url"] + "/v1", api_key=server["key"], max_retries=0)
    )


SAMPLING = {
    "max_tokens": 12,
    "temperature": 1.0,
    # logprobs + return_token_ids: verifiers then fills trajectory[i]["tokens"]
    "logprobs": True,
    # min_tokens: the untrained model samples <|im_end|> first ~1% of the time; an empty
    # answer is an EmptyModelResponseError rollout in verifiers 0.3.1 (error, reward 0)
    "extra_body": {"return_token_ids": True, "min_tokens": 4},
}


def _check_outputs(outputs, tokenizer):
    for out in outputs:
        assert out["error"] is None
        completion = out["completion"]
        assert len(completion) == 1 and completion[0].role == "assistant"
        text = completion[0].content or ""
        assert 0.0 <= out["reward"] <= 1.0
        assert out["reward"] == pytest.approx(lcs_ratio(text.strip(), out["answer"]))
        assert out["metrics"]["lcs_reward"] == out["reward"]
        step = out["trajectory"][0]
        tokens = step["tokens"]
        assert tokens is not None
        ids, lps = tokens["completion_ids"], tokens["completion_logprobs"]
        assert 1 <= len(ids) == len(lps) <= SAMPLING["max_tokens"]
        assert all(lp <= 0.0 for lp in lps)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        prompt_msgs = [m.model_dump(include={"role", "content"}) for m in out["prompt"]]
        assert tokenizer.decode(tokens["prompt_ids"]) == tokenizer.apply_chat_template(
            prompt_msgs, tokenize=False, add_generation_prompt=True
        )


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_generate_and_evaluate_against_vllm(vllm_server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vllm_server["model_dir"], local_files_only=True)
    env = reverse_text.load_environment(num_train_examples=4, num_eval_examples=3)
    quiet = lambda *a, **k: None  # noqa: E731  (replaces the tqdm bar)

    async def run():
        # One event loop for both calls: the AsyncOpenAI (httpx) client is bound to the
        # loop it first ran on; reusing it under a second asyncio.run() makes every
        # rollout fail with "Event loop is closed" (reported in out["error"], not raised).
        client = _client(vllm_server)
        # training-style: env.get_dataset() (has example_id), 2 rollouts per example
        gen = await env.generate(
            env.get_dataset().repeat(2),
            client=client,
            model=vllm_server["model"],
            sampling_args=SAMPLING,
            state_columns=["trajectory"],
            on_progress=quiet,
        )
        # evaluation: the eval split, rollouts_per_example
        ev = await env.evaluate(
            client=client,
            model=vllm_server["model"],
            sampling_args=SAMPLING,
            rollouts_per_example=2,
            state_columns=["trajectory"],
            on_progress=quiet,
        )
        return gen, ev

    res, ev = asyncio.run(run())
    outs = res["outputs"]
    assert len(outs) == 8
    assert sorted(o["example_id"] for o in outs) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert res["metadata"]["rollouts_per_example"] == 2
    _check_outputs(outs, tok)

    assert len(ev["outputs"]) == 6
    answers = {o["answer"] for o in ev["outputs"]}
    assert answers == set(env.get_eval_dataset()["answer"])
    _check_outputs(ev["outputs"], tok)
    avg = sum(o["reward"] for o in ev["outputs"]) / 6
    assert ev["metadata"]["avg_reward"] == pytest.approx(avg)
