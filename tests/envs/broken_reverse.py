"""A test environment: reverse_text, broken in one way (`fail`), for runs that must end
with one line naming the env's error.

- "rollout": after the model's first answer the env's own turn raises (a tool the task
  needs fails); verifiers records the error in the rollout;
- "empty": every rollout ends before the model is asked anything (a stop condition that
  always holds): no completion at all.

(A reward function that always raises: flaky_reverse with raise_every=1.)"""

import reverse_text
import verifiers as vf

FAILS = ("rollout", "empty")


class BrokenReverse(vf.MultiTurnEnv):
    def __init__(self, fail: str, **kwargs):
        super().__init__(**kwargs)
        self.fail = fail

    async def env_response(self, messages, state, **kwargs):
        raise vf.ToolCallError("the reversal checker refused the call: connection reset")

    @vf.stop
    async def nothing_to_ask(self, state) -> bool:
        return self.fail == "empty"


def load_environment(fail: str = "rollout", **kwargs):
    if fail not in FAILS:
        raise ValueError(f"fail must be one of {', '.join(FAILS)} (got {fail!r})")
    base = reverse_text.load_environment(**kwargs)
    return BrokenReverse(
        fail,
        dataset=base.dataset,
        eval_dataset=base.eval_dataset,
        system_prompt=None,
        parser=base.parser,
        rubric=base.rubric,
        max_turns=2,
    )
