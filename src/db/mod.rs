//! The databases the layers above share, as connections and schemas, knowing none of their
//! tables: [`postgres`], the PostgreSQL server of `--database-url` (the recordings and
//! cluster mode). Each owner of tables (the recording, the cluster) defines its own
//! migrations; this layer applies them.

pub mod postgres;
