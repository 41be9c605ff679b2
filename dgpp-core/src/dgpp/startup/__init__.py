"""What runs once before serving: the deployment resolved (checkpoint, config.json, family), the model loaded and
assembled from a family's declaration, the memory plan (the family's or the generic estimate), the engine keys
checked against the loaded model, and the speculative decoder built. What runs every step is ``dgpp.engine``'s."""
