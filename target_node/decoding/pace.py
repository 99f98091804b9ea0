"""How many prompt tokens a batched forward may carry, so a long prompt does not stall the others.

Every running request waits for each forward, so a forward that carries a chunk of a 3,000-token
prompt is a pause in everyone else's stream, and a request that arrives meanwhile waits for it
before its own first token. The pace sizes chunks to a time budget per forward from the rate
prefill forwards were measured at on this machine, in this run: the rate falls as a prompt's
context (its attention) grows, and differs by machine, model and dtype, so it is learned, not set.
"""

from __future__ import annotations

FIRST_CHUNK = 64  # before any forward is measured: small enough to be quick anywhere
FEWEST = 16  # below this many prompt rows in all a forward's fixed costs dominate them
GROWTH = 2.0  # at most this many times the last chunk, so one fast forward cannot overshoot far


class PrefillPace:
    def __init__(self, budget_s: float, most: int) -> None:
        """`budget_s`: what one forward that carries prompt rows should take; `most`: a cap on the
        rows in one chunk (memory for activations grows with it)."""
        if budget_s <= 0 or most < 1:
            raise ValueError(f"a prefill pace needs a budget > 0 and a chunk cap >= 1, got {budget_s}, {most}")
        self.budget_s, self.most = budget_s, most
        self.rows_per_s: float | None = None
        self.last = FIRST_CHUNK

    def chunk(self, prefilling: int = 1, alone: bool = False) -> int:
        """Prompt rows for each of `prefilling` requests in the next forward (they share the budget).

        A prompt `alone` (no other request runs or waits) pauses no one: it takes the cap, since
        every forward has a fixed cost (the weights read once more) that small chunks pay many
        times: budget-sized chunks made a 3,000-token prompt's first token 40% later than one
        forward. A request arriving meanwhile waits for that chunk, then the pace resumes.

        The floor of FEWEST rows is the forward's, shared like the budget: taken by each prompt, four
        3,000-token prompts in prefill together put 64 rows in every forward where the budget held 23,
        and a stream beside them waited 0.37 s a token (p50; 0.70 s at worst) under a 150 ms budget (an audit)."""
        if alone:
            return self.most
        if self.rows_per_s is None:
            rows = FIRST_CHUNK
        else:
            rows = min(self.rows_per_s * self.budget_s, self.last * GROWTH)
        return max(1, min(self.most, int(max(rows, FEWEST) / max(prefilling, 1))))

    def record(self, rows: int, prompt_rows: int, seconds: float) -> None:
        """A forward of `rows` rows in all, `prompt_rows` of them prompt chunks, took `seconds`."""
        if prompt_rows <= 0 or seconds <= 0:
            return
        rate = rows / seconds
        # The newest forward counts most: the rate moves with the prompt's context length.
        self.rows_per_s = rate if self.rows_per_s is None else 0.5 * self.rows_per_s + 0.5 * rate
        self.last = max(prompt_rows, FEWEST)

    def to_dict(self) -> dict:
        return {"budget_s": self.budget_s, "most": self.most, "rows_per_s": self.rows_per_s}
