//! Node agents' own credentials: made and revoked by an operator, checked on every
//! NodeService call. Only the SHA-256 of a secret is stored; the secret is returned once.
//! Revoking a node's last live credential fences the node (`store::fence`).

use sea_orm::sea_query::Expr;
use sea_orm::{ColumnTrait, EntityTrait, PaginatorTrait, QueryFilter, QueryOrder, QuerySelect};

use super::Store;
use super::entities::node_credential;
use crate::error::ReconcilerError;

type Result<T> = std::result::Result<T, ReconcilerError>;

/// The prefix of every node credential, so a leaked one is recognisable as such.
pub const TOKEN_PREFIX: &str = "rpnode_";

/// Lower-case hex of `token`'s SHA-256, as `node_credentials.token_sha256` keeps it.
pub fn token_sha256(token: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What one [`Store::revoke_node_credentials`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Revoked {
    /// Credentials this call revoked (0 for a replay).
    pub credentials: u64,
    /// Whether this call fenced the node (false when it was fenced already, or never
    /// registered).
    pub fenced: bool,
    /// Live sandboxes of the node this call ended as lost.
    pub fenced_sandboxes: u64,
}

/// Most rows one listing returns.
pub const LIST_LIMIT: u64 = 1000;

impl Store {
    /// A new live credential for `node_id`: its row and its secret (244 random bits from
    /// two v4 UUIDs, after [`TOKEN_PREFIX`]). The secret is not kept.
    pub async fn create_node_credential(
        &self,
        node_id: &str,
        max_capacity: u32,
    ) -> Result<(node_credential::Model, String)> {
        let token = format!(
            "{TOKEN_PREFIX}{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        let row = node_credential::Model {
            id: uuid::Uuid::new_v4().to_string(),
            node_id: node_id.to_owned(),
            token_sha256: token_sha256(&token),
            created_at_us: self.now_us(),
            max_capacity: max_capacity.into(),
            revoked_at_us: None,
        };
        node_credential::Entity::insert(node_credential::ActiveModel::from(row.clone()))
            .exec_without_returning(&self.db)
            .await
            .map_err(ReconcilerError::from)?;
        Ok((row, token))
    }

    /// Revokes `node_id`'s live credentials and, in the same transaction, fences the node
    /// once it has no live credential left (see `store::fence`): no placement on it any
    /// more, and every live sandbox it holds lost at once.
    pub async fn revoke_node_credentials(&self, node_id: &str) -> Result<Revoked> {
        let txn = runplane_db::write_tx(&self.db).await?;
        let now = self.now_us();
        let credentials = node_credential::Entity::update_many()
            .col_expr(node_credential::Column::RevokedAtUs, Expr::value(now))
            .filter(node_credential::Column::NodeId.eq(node_id))
            .filter(node_credential::Column::RevokedAtUs.is_null())
            .exec(&txn)
            .await?
            .rows_affected;
        // One made while this call ran, committed before the update read, keeps the node.
        let live_left = node_credential::Entity::find()
            .filter(node_credential::Column::NodeId.eq(node_id))
            .filter(node_credential::Column::RevokedAtUs.is_null())
            .count(&txn)
            .await?;
        let fenced = if live_left == 0 {
            self.fence_node(&txn, node_id, now).await?
        } else {
            None
        };
        txn.commit().await?;
        Ok(Revoked {
            credentials,
            fenced: fenced.is_some(),
            fenced_sandboxes: fenced.unwrap_or(0),
        })
    }

    /// Credentials, revoked included, oldest first (of `node_id` when given).
    pub async fn list_node_credentials(
        &self,
        node_id: Option<&str>,
    ) -> Result<Vec<node_credential::Model>> {
        let mut query = node_credential::Entity::find();
        if let Some(node_id) = node_id {
            query = query.filter(node_credential::Column::NodeId.eq(node_id));
        }
        query
            .order_by_asc(node_credential::Column::CreatedAtUs)
            .order_by_asc(node_credential::Column::Id)
            .limit(LIST_LIMIT)
            .all(&self.db)
            .await
            .map_err(ReconcilerError::from)
    }

    /// The credential whose secret hashes to `sha256_hex`, live or revoked.
    pub async fn node_credential_by_hash(
        &self,
        sha256_hex: &str,
    ) -> Result<Option<node_credential::Model>> {
        node_credential::Entity::find()
            .filter(node_credential::Column::TokenSha256.eq(sha256_hex))
            .one(&self.db)
            .await
            .map_err(ReconcilerError::from)
    }
}
