"""Scale-out: worker agents that dial in to the stream-serve authority, and the launchers that place them."""
