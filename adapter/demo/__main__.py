from adapter.demo.run import main

raise SystemExit(main())
