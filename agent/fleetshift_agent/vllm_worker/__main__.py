from fleetshift_agent.vllm_worker.app import main

raise SystemExit(main())
