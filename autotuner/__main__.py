from autotuner.app.cli import main

raise SystemExit(main())
