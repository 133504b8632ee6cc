"""Grading's part of each host agent's pass: the host's dedicated endpoints kept in step with its engine,
and deleted when a budget that pays for them is reached."""

from __future__ import annotations

from sandboxes.agent import PASSES
from sandboxes.worker.budgets import REACHED

from .worker import endpoints_over_budget, endpoints_reconcile

PASSES.append(endpoints_reconcile)
REACHED.append(endpoints_over_budget)
