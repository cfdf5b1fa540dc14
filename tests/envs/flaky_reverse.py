"""A test environment: reverse_text whose reward raises on some examples and is constant
on others (to exercise errored rollouts and difficulty filtering)."""

import reverse_text
import verifiers as vf


def load_environment(raise_every: int = 0, constant_every: int = 0, fail_load: bool = False, **kwargs):
    if fail_load:
        raise RuntimeError("cannot reach the task server\n(details on a second line)")
    base = reverse_text.load_environment(**kwargs)

    def reward(completion, answer, info=None, **kw) -> float:
        n = len(answer)
        if raise_every and n % raise_every == 0:
            raise ValueError(f"reward exploded on {answer!r}")
        if constant_every and n % constant_every == 0:
            return 1.0
        return reverse_text.lcs_reward(completion, answer, parser=base.parser)

    return vf.SingleTurnEnv(
        dataset=base.dataset,
        eval_dataset=base.eval_dataset,
        system_prompt=None,
        parser=base.parser,
        rubric=vf.Rubric(funcs=[reward], parser=base.parser),
    )
