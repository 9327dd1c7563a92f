"""Code that runs inside Ray Serve replicas: the HTTP app and the image parsing."""
