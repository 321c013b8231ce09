"""Commands that live in their own modules; ``sweeps.cli`` imports them when present and
they register themselves with ``@command``."""
