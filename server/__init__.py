"""rgpu serve: the listener, one worker process per session, and the routes."""
