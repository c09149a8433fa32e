"""Private swarms: a shared swarm key, MACs on every DHT RPC, and a membership proof before any corolla RPC.

What it protects against, and what not, is in the README ("Private swarms")."""

from corolla.membership.dht_auth import SwarmKeyAuthorizer
from corolla.membership.gate import MEMBER_PROTOCOL, MembershipGate, serve_proofs
from corolla.membership.key import SwarmKey, generate_swarm_key, load_swarm_key

__all__ = ["MEMBER_PROTOCOL", "MembershipGate", "SwarmKey", "SwarmKeyAuthorizer", "generate_swarm_key",
           "load_swarm_key", "serve_proofs"]
