from adapter.cli import main

raise SystemExit(main())
