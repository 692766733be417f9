"""raytrain_loops: the research training loop as one configurable engine, scaled out with Ray."""
