from qosgate.cli import main

raise SystemExit(main())
