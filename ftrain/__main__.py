"""`python -m ftrain`: the command-line interface, an extra (`ftrain/extras/cli.py`)."""

if __name__ == "__main__":
    from ftrain.extras.cli import main

    raise SystemExit(main())
