from router_sync.cli import main

raise SystemExit(main())
