from fleetshift_agent.worker.app import main

raise SystemExit(main())
