"""`meridian`: the command line for Meridian's users (stdlib + requests + protocol, never Django)."""
