"""The engines' KV caches as the router knows them: events decoded, each rank's tree and tiers, freshness, predictions, what the engines report."""
