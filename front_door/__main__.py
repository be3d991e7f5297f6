from front_door.cli import main

raise SystemExit(main())
