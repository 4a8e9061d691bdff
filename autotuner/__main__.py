from autotuner.app.entry import main

raise SystemExit(main())
