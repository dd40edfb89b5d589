"""cli: the face: the typer app (`app`), its commands (`commands/`), terminal output, live progress,
JUnit and summaries, and `rerun` (handed the run function, never the app).
May import every other folder; nothing outside cli/ imports it (only the entry points above it).
"""


def main() -> None:
    """The `lora-parity` console script (`lora_parity.cli:main`): the typer app in `cli.app`, imported
    only when called so that importing a `cli` module does not build the app."""
    from lora_parity.cli.app import main as app_main

    app_main()
