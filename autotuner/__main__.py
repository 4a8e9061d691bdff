from autotuner.cli import main

raise SystemExit(main())
