"""The shared contract between the services: ids, time, exits, refusals, the user_config and deployment file, engine policy, heartbeat timing."""
