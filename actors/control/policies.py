"""The policies the planner decides with, as the ``planner:`` config section sets them, and their live switch.

It holds the placement policy's name and params (the routers build their own instance from them, with the
planner's cost model), the planner's own instance of it for training work (``planners/placement/training.py``:
LEMIX Eq. 1–4, under ``placement: separate`` the split of LEMIX §VI-A), and the SLOs the nodes' co-serving runs
under, checked against the cost profile (``planners/coserving/slo.py``). :meth:`Policies.switch` builds every
policy of a new section first, so a bad setting fails and changes nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from actors.control.nodes import NodeRecord
from planners import registry
from planners.coserving.priorities import as_priority_weights
from planners.coserving.slo import SloCheck, check_slos
from planners.costs import CostModel
from planners.memory import MemoryGuard
from planners.placement import Separate, TrainingPlacer
from settings import AppConfig, PlannerConfig

logger = logging.getLogger(__name__)


def checked_slos(cfg: AppConfig, planner: PlannerConfig, cost_model: CostModel) -> SloCheck:
    """The SLOs the nodes' co-serving runs under, checked against the profile; problems are logged
    here, at start-up, and shown in ``/v1/status`` (``slo``)."""
    t, params = cfg.training, planner.iteration_params
    check = check_slos(
        cost_model.with_stages(cfg.cluster.stages),
        t.slo_tbt_s,
        t.slo_ttft_s,
        int(params.get("min_window_tokens", 16)),
        as_priority_weights(params.get("weights")),
    )
    for problem in check.problems:
        logger.warning("SLO: %s", problem)
    return check


class Policies:
    """The placement policy (name, params, the planner's training instance) and the SLOs in force."""

    def __init__(self, cfg: AppConfig, cost_model: CostModel, nodes: list[NodeRecord], slo: SloCheck) -> None:
        self.cfg = cfg  # the planner's config object: switch swaps its planner section in place
        self.cost_model = cost_model
        self.nodes = nodes
        self.slo = slo
        self.placement = cfg.planner.placement
        self.placement_params = dict(cfg.planner.placement_params)
        self.training = self._training_placer(self.placement, self.placement_params)

    def _placement_kwargs(self, name: str, params: dict[str, Any]) -> dict[str, Any]:
        params = dict(params)
        for key, value in (
            ("cost_model", self.cost_model.with_stages(self.cfg.cluster.stages)),
            ("stages", self.cfg.cluster.stages),
        ):
            if key not in params and registry.accepts("placement", name, key):
                params[key] = value
        return params

    def placement_kwargs(self) -> dict[str, Any]:
        """The current placement policy's keyword arguments, cost model included (for routers)."""
        return self._placement_kwargs(self.placement, self.placement_params)

    def _training_placer(self, name: str, params: dict[str, Any]) -> TrainingPlacer:
        """This planner's own instance of placement policy ``name``, for training decisions.

        Eq. 4's τ_R on the grant path is ``training.slo_ttft_s`` unless the params set ``response_slo_s``: the
        routers' instances keep the policy's own default (only training ever meets Eq. 4).
        """
        kwargs = self._placement_kwargs(name, params)
        if "response_slo_s" not in kwargs and registry.accepts("placement", name, "response_slo_s"):
            kwargs["response_slo_s"] = self.cfg.training.slo_ttft_s
        policy = registry.create("placement", name, **kwargs)
        t = self.cfg.training
        if isinstance(policy, Separate):
            problem = policy.problem(len(self.nodes), t.enabled, t.scope_rules)
            if problem:
                raise ValueError(problem)
        placer = TrainingPlacer(policy, [n.node_id for n in self.nodes])
        n_train = len(placer.training_nodes())
        if t.enabled and -(-(t.workers or n_train) // n_train) > self.cfg.ranks_per_node:
            # The bundles were sized at deploy time for cfg.ranks_per_node ranks a node.
            raise ValueError(
                f"{t.workers} trainer ranks on {n_train} training node(s) would not fit the bundles, "
                f"sized for {self.cfg.ranks_per_node} rank(s) a node"
            )
        return placer

    def switch(self, planner: PlannerConfig) -> bool:
        """Switch to the policies of ``planner`` (a ``planner:`` config section); True when the nodes that
        train changed (``separate``), so the trainer must regroup.

        Every policy is built first, so a bad setting fails here and changes nothing. A changed co-serving
        policy or memory guard starts afresh on every node (grant and pass logs included); routers build a
        changed placement policy at their next snapshot.
        """
        placer = self._training_placer(planner.placement, dict(planner.placement_params))
        if planner.iteration is not None:
            registry.create("iteration", planner.iteration, **planner.iteration_params)
        MemoryGuard(self.cost_model.with_stages(self.cfg.cluster.stages), **planner.memory_params)
        old = self.cfg.planner
        coserving_changed = (planner.iteration, planner.iteration_params, planner.memory_params) != (
            old.iteration,
            old.iteration_params,
            old.memory_params,
        )
        before = self.training.training_nodes()
        self.cfg.planner = planner
        self.placement, self.placement_params, self.training = planner.placement, dict(planner.placement_params), placer
        if coserving_changed:
            self.slo = checked_slos(self.cfg, planner, self.cost_model)
            for node in self.nodes:
                node.coserving.slo_tbt_s = self.slo.tbt_s
                node.coserving.reset()
        return placer.training_nodes() != before
