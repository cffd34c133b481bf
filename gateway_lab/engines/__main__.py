from gateway_lab.engines.cli import main

raise SystemExit(main())
