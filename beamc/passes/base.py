"""What a pass is: a name, the seed change it implements (its module docstring), and its rewrite rules."""
from __future__ import annotations

from dataclasses import dataclass, field

from beamc.passes.rewrite import Rule


@dataclass(frozen=True)
class Pass:
    name: str
    doc: str
    rules: list[Rule] = field(default_factory=list)
