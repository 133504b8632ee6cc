"""Budgets before a call: the most an inference call could cost, against what its budgets have spent.

A call is refused (``402``, the code naming the budget: ``team_budget_exceeded`` or
``key_budget_exceeded``) before anything is sent upstream when a budget of its team or
key is spent, or when what the call could cost would take it past its limit. What a
call could cost is its prompt's bytes (more than its tokens can be) at the model's
input price, plus its ``max_completion_tokens`` (or ``max_tokens``; ``UNBOUNDED_OUTPUT``
when it names neither) times ``n`` at the output price, from the rate card
(``billing``), times the tries a structured answer may take. Through the team's
own dedicated endpoint tokens cost nothing (its seconds are billed), so only a
budget already spent refuses such a call.

What has been spent is read with the team's gateway configuration (``selectors``,
kept ``CONFIG_TTL_S``); the calls this process admitted since are added at what they
could cost, so that a burst cannot pass a limit the reading has not caught up with.
The calls' real tokens are metered after they answer (``MeteredUsage``), and are
what the statement and the next reading count.
"""

from __future__ import annotations

from decimal import Decimal

from billing.budgets import over_budget

from .schemas import ChatCompletionRequest
from .selectors import GatewayConfig, Route

UNBOUNDED_OUTPUT = 4096  # output tokens counted for a call that names no limit
PER_MILLION = Decimal(1_000_000)


def most_it_could_cost(config: GatewayConfig, routes: tuple[Route, ...], request: ChatCompletionRequest, body_bytes: int) -> Decimal:
    if all(route.dedicated for route in routes):
        return Decimal(0)
    input_price, output_price = config.prices.get(request.model, (Decimal(0), Decimal(0)))
    output = (request.max_completion_tokens or request.max_tokens or UNBOUNDED_OUTPUT) * (request.n or 1)
    return (Decimal(body_bytes) * input_price + Decimal(output) * output_price) / PER_MILLION


def admit(config: GatewayConfig, key_id: str, cost: Decimal) -> None:
    """Refuse the call (``OverBudget``) if a budget it counts against cannot take ``cost`` more; else count it."""
    applying = [state for state in config.budgets if state.applies_to(key_id)]
    for state in applying:
        spent = state.spent + config.admitted.get(state.budget.pk, Decimal(0))
        limit = state.budget.monthly_limit
        if spent >= limit or spent + cost > limit:
            raise over_budget(state.budget, spent, cost, "this inference call")
    for state in applying:
        config.admitted[state.budget.pk] = config.admitted.get(state.budget.pk, Decimal(0)) + cost
