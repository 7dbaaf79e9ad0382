"""A local cluster on one machine, for tests and for trying the operator without Kubernetes.

This is a test harness, not a scheduler: it does the few things a kubelet and cluster DNS would do
for the objects our operator writes, on one "node", and nothing more.

- `api`: the kmock Kubernetes API emulator on 127.0.0.1 and the real operator (kopf) against it, with what
  kubectl needs besides (`discovery`: discovery and OpenAPI documents; `tables`: `kubectl get`'s columns);
- `pods`: a pod runner that starts each replica of every Deployment as a process in its own network
  namespace with its own IP, runs its probes, restarts it when liveness fails, follows replica
  changes and reports Pod and Deployment status back to the emulator;
- `network`: the bridge, namespaces and veth pairs (names start with `qs-`, addresses 10.213.0.0/24;
  pods get no default route, so their traffic stays on the bridge);
- `network_policy`: the namespace's NetworkPolicies as nftables rules on the bridge, per pod;
- `dns`: a small DNS server on the bridge answering `<svc>.<ns>.svc.cluster.local` with the ready pods'
  IPs (every Service is answered like a headless one) and nothing else;
- `cli`: `qwen-serve dev-cluster up -f FILE` (it writes a kubeconfig) and `qwen-serve dev-cluster scale STAGE N`.

Needs root (network namespaces, a bridge, a tmpfs per pod at /dev/shm).
"""
