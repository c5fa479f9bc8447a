"""slofleet's autoscaler: engine metrics -> per-role signals -> an SLO-driven policy, and the fleet
simulator (with today's baselines) that checks the policy on real and synthesized traces. Never imports torch."""
from .policy import SLO, Decision, Fleet, Policy, PolicyConfig
from .signals import RoleSignals, Window, parse, window

__all__ = ["SLO", "Decision", "Fleet", "Policy", "PolicyConfig", "RoleSignals", "Window", "parse", "window"]
