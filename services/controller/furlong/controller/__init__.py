"""The Furlong controller: run specs, the run state machine and store, the synchronous RL loop
driver, the REST API, the `furlong` CLI and the local stack launcher."""
