"""What an attack in corolla.testing reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttackResult:
    attack: str
    succeeded: bool  # the attack did what it wanted: a security failure
    details: str
