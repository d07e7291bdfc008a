"""The MiniSGLModel operator: each resource becomes the Deployment and Service that the minisgl Helm chart
renders for its spec, with a status read from the pods. Run it with `python -m minisgl_operator`."""
