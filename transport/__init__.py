"""Frames between client and server: wire format, handshake, transports, queues."""
