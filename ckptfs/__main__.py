from ckptfs.cli.main import main

raise SystemExit(main())
