"""The ``sweeps`` subcommands. Each module lists the ones it defines in ``COMMANDS`` (a tuple
of :class:`sweeps.commands.base.Command`); ``sweeps.cli`` builds the parser from those lists,
in one place."""
