"""Discovery: where the pods come from. A static source (YAML file and/or one-line list:
static), Kubernetes pods by label (k8s) and an InferencePool (inferencepool), over one
list+watch client (kube); every source fills a routing.registry.PodRegistry.

It imports routing's core modules (pods, registry, errors, metrics) and nothing else of routing.
"""
