"""`python -m monobatch` is the `monobatch` command."""

from monobatch.cli.main import main

raise SystemExit(main())
